"""Rollout workers on this machine: policy sync, restarts of crashed or hung actors, no leaks."""

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rl_checks import check_versions, collect_until_version, new_weights

from uma_lightning.rl.data import RolloutDataModule
from uma_lightning.rl.env import probe_env
from uma_lightning.rl.local import ActorSetup, LocalActors
from uma_lightning.rl.policy import GaussianMLPPolicy

# Every test starts rollout worker processes.
pytestmark = pytest.mark.slow

SERVER = {"max_batch": 8, "max_wait": 0.005, "device": "cpu"}


@pytest.fixture(scope="module")
def spec():
    return probe_env("Pendulum-v1")


@pytest.mark.parametrize("inference", ["local", "server"])
def test_actors_act_with_the_newest_weights_after_every_sync_without_stopping(spec, inference):
    policy = GaussianMLPPolicy(spec, hidden=(16,))
    actors = LocalActors(
        ActorSetup(spec, n_envs=3, steps=8, seed=0),
        policy,
        n_workers=2,
        server=SERVER if inference == "server" else None,
        heartbeat_timeout=60,
    )
    try:
        snapshots, newest_seen = {}, {}
        for version in range(4):
            new_weights(policy, seed=version)
            snapshots[version] = copy.deepcopy(policy)
            actors.publish(policy.state_dict(), version)
            if version == 0:
                pids = actors.pids
            check_versions(collect_until_version(actors, version), snapshots, newest_seen)
        assert actors.pids == pids and actors.restarts == 0  # picked up while running, no restart
    finally:
        actors.close()


@pytest.mark.alone  # a worker slower than the 2 s heartbeat would be restarted as hung
def test_a_crashed_or_hung_actor_is_restarted_and_its_unfinished_chunk_discarded(tmp_path):
    marker = tmp_path / "hang"
    kwargs = {"marker": str(marker)}
    spec = probe_env("rl_envs:hanging_pendulum", kwargs)
    policy = GaussianMLPPolicy(spec, hidden=(16,))
    actors = LocalActors(
        ActorSetup(spec, env_kwargs=kwargs, n_envs=2, steps=10, seed=0), policy, n_workers=2, heartbeat_timeout=2.0
    )
    received = []

    def collect_until(condition, limit=120.0):
        deadline = time.monotonic() + limit
        while not condition():
            assert time.monotonic() < deadline, "actors did not recover"
            received.append(actors.next_chunk(timeout=limit))

    try:
        actors.publish(policy.state_dict(), 0)
        collect_until(lambda: len(received) >= 4)
        # Crash: the learner notices, restarts the worker, and keeps receiving data.
        crashed_pid = actors.workers[0].process.pid
        os.kill(crashed_pid, signal.SIGKILL)
        collect_until(lambda: any(c.worker == 0 and c.incarnation == 1 for c in received))
        assert actors.restarts == 1 and actors.pids[0] != crashed_pid and not psutil.pid_exists(crashed_pid)
        # Hang: one env blocks inside step(); the heartbeat stops and the worker is killed and replaced.
        marker.touch()
        collect_until(lambda: actors.restarts == 2)
        hung = next(w.index for w in actors.workers if w.incarnation == (2 if w.index == 0 else 1))
        collect_until(
            lambda: any(c.worker == hung and c.incarnation == actors.workers[hung].incarnation for c in received)
        )
        assert not marker.exists()
        # Nothing from a replaced incarnation arrives after its successor's first chunk, and a new
        # incarnation starts from a fresh sequence: the chunk being written when it died is gone.
        for worker in (0, 1):
            mine = [(c.incarnation, c.sequence) for c in received if c.worker == worker]
            assert mine == sorted(mine)
            for incarnation in {i for i, _ in mine}:
                sequences = [s for i, s in mine if i == incarnation]
                assert sequences == list(range(1, len(sequences) + 1))
        assert all(bool((c.data["version"] == 0).all()) for c in received)
    finally:
        actors.close()


def test_chunks_staler_than_the_max_policy_lag_are_dropped_and_counted():
    data = RolloutDataModule(
        "Pendulum-v1", n_workers=1, envs_per_worker=2, steps_per_chunk=4, max_policy_lag=1, slots_per_worker=3, seed=0
    )
    policy = GaussianMLPPolicy(data.env_spec, hidden=(16,))
    data.start(policy, return_discount=0.99)
    try:
        data.publish(policy, 0)
        assert data.actors.workers[0].ready.poll(120)  # a chunk acted by version 0 waits in its slot
        data.publish(policy, 1)
        data.publish(policy, 2)  # version 0 is now 2 behind
        batch = data.next_batch()
        stats, versions = batch["stats"], batch["trajectories"]["version"]
        dropped = stats["policy_lag/dropped_chunks"]
        assert dropped >= 1 and data.dropped_chunks == dropped
        assert int(versions.min()) >= 1 and stats["policy_lag/max"] <= 1
        assert data.env_steps == (1 + dropped) * 2 * 4  # dropped chunks count as collected, not as trained on
        # The histogram counts the dropped chunk too: kept lags share what is left.
        assert stats["policy_lag/lag_0"] + stats["policy_lag/lag_1"] == pytest.approx(1 / (1 + dropped))
    finally:
        data.teardown("fit")


LEAK_SCRIPT = """
import os, signal, sys, time, torch
import multiprocessing.forkserver as forkserver
from uma_lightning.rl.env import probe_env
from uma_lightning.rl.local import ActorSetup, LocalActors
from uma_lightning.rl.policy import GaussianMLPPolicy
from uma_lightning.rl.replay import ReplayBuffer


class ScriptPolicy(GaussianMLPPolicy):  # defined here: the actors must import this script to unpickle it
    pass


if __name__ == "__main__":
    spec = probe_env("Pendulum-v1")
    policy = ScriptPolicy(spec, hidden=(16,))
    buffer = ReplayBuffer(100, {"x": ((), torch.float32)})  # holds a named semaphore (its lock)
    actors = LocalActors(ActorSetup(spec, n_envs=2, steps=8), policy, 2, server=%r, heartbeat_timeout=30)
    actors.publish(policy.state_dict(), 0)
    for _ in range(4):
        actors.next_chunk(timeout=120)
    os.kill(actors.workers[0].process.pid, signal.SIGKILL)  # an actor crashes
    while actors.restarts == 0:
        actors.next_chunk(timeout=120)
    pids = actors.pids + [actors.server.process.pid, forkserver._forkserver._forkserver_pid]
    print("SEM", buffer.lock._semlock.name.lstrip("/"), "PIDS", *pids, flush=True)
    if sys.argv[1] == "hold":
        time.sleep(600)  # the test kills this learner
    actors.close()
    print("CLOSED", flush=True)
"""


def leftovers(pids: list[int], semaphore: str) -> list[str]:
    """/dev/shm entries of this run and processes of it still alive."""
    entries = [
        name for name in os.listdir("/dev/shm") if name == f"sem.{semaphore}" or any(f"_{pid}_" in name for pid in pids)
    ]
    return entries + [f"process {pid}" for pid in pids if running(pid)]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone, possibly between listing and looking
        return False


def wait_clean(pids: list[int], semaphore: str, limit: float = 30.0) -> list[str]:
    deadline = time.monotonic() + limit
    while (left := leftovers(pids, semaphore)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_no_process_semaphore_or_shared_memory_outlives_shutdown_or_a_killed_learner(tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(LEAK_SCRIPT % (SERVER,))
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}

    # Shutdown after an actor crashed: everything released, and the resource tracker has nothing to clean.
    done = subprocess.run([sys.executable, str(script), "close"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    semaphore, pids = words[1], [int(p) for p in words[3 : words.index("CLOSED")]]
    assert wait_clean(pids, semaphore) == []
    assert "leaked" not in done.stderr, done.stderr[-3000:]

    # The learner is SIGKILLed: actors, server and forkserver notice and exit; the tracker unlinks the semaphore.
    learner = subprocess.Popen(
        [sys.executable, str(script), "hold"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        words = learner.stdout.readline().split()
        assert words and words[0] == "SEM", learner.stderr.read()[-3000:]
        semaphore, pids = words[1], [int(p) for p in words[3:]]
        assert Path(f"/dev/shm/sem.{semaphore}").exists()
        learner.kill()
        learner.wait(timeout=30)
        assert wait_clean(pids, semaphore) == []
    finally:
        learner.kill()
