"""The Ray backend on a local `ray.init` cluster: the same interface and guarantees as local actors."""

import copy
import os
import signal
import time

import pytest
from rl_checks import check_versions, collect_until_version, new_weights
from suite import TESTS

from uma_lightning.rl.env import probe_env
from uma_lightning.rl.local import ActorSetup
from uma_lightning.rl.policy import GaussianMLPPolicy

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    # Two CPUs, one per rollout worker; the tests' env factories importable by Ray's worker processes;
    # the dashboard, which answers Ray's state API (`ray list actors`).
    ray.init(
        num_cpus=2, include_dashboard=True, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}}
    )
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.alone  # a worker slower than the 4 s heartbeat would be restarted as hung
def test_ray_actors_sync_weights_restart_crashed_and_hung_workers_and_batch_on_a_server(cluster, tmp_path):
    from uma_lightning.rl.ray_backend import RayActors

    marker = tmp_path / "hang"
    kwargs = {"marker": str(marker)}
    spec = probe_env("rl_envs:hanging_pendulum", kwargs)
    policy = GaussianMLPPolicy(spec, hidden=(16,))
    setup = ActorSetup(spec, env_kwargs=kwargs, n_envs=2, steps=8, seed=0)
    actors = RayActors(setup, policy, n_workers=2, heartbeat_timeout=4.0)
    try:
        snapshots, newest_seen = {}, {}
        for version in range(3):
            new_weights(policy, seed=version)
            snapshots[version] = copy.deepcopy(policy)
            actors.publish(policy.state_dict(), version)
            check_versions(collect_until_version(actors, version), snapshots, newest_seen)
        # A learner busy for longer than the timeout (a long update) finds finished calls, not hung workers.
        time.sleep(5.0)
        actors.next_chunk(timeout=60)
        actors.next_chunk(timeout=60)
        assert actors.restarts == 0
        # Crash: Ray restarts the worker; the learner discards the lost call and keeps receiving chunks.
        os.kill(actors.worker_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while actors.restarts < 1 or actors.next_chunk(timeout=180).incarnation < 1:
            assert time.monotonic() < deadline
            actors.next_chunk(timeout=180)
        # Hang: a call that does not finish in time marks the worker hung; it is killed and restarted.
        marker.touch()
        while actors.restarts < 2:
            assert time.monotonic() < deadline + 120
            actors.next_chunk(timeout=180)
        assert not marker.exists()
        # Restarted workers act with the newest weights.
        new_weights(policy, seed=3)
        snapshots[3] = copy.deepcopy(policy)
        actors.publish(policy.state_dict(), 3)
        check_versions(collect_until_version(actors, 3), snapshots, {})
    finally:
        actors.close()
    # A central inference server batches both workers' requests; chunks carry its version.
    server = {"max_batch": 4, "max_wait": 0.01, "device": "cpu"}
    actors = RayActors(
        ActorSetup(spec, env_kwargs=kwargs, n_envs=2, steps=8, seed=1), policy, n_workers=2, server=server
    )
    try:
        actors.publish(policy.state_dict(), 4)
        snapshots[4] = copy.deepcopy(policy)
        check_versions(collect_until_version(actors, 4), {4: snapshots[4]}, {})
    finally:
        actors.close()


@pytest.mark.slow
def test_ray_actors_are_named_by_role_and_index(cluster):
    """As `ray list actors` shows them: through Ray's state API, in the run's own namespace."""
    from ray.util.state import list_actors

    from uma_lightning.rl.ray_backend import RayActors

    spec = probe_env("rl_envs:hanging_pendulum", {"marker": "/nonexistent"})
    setup = ActorSetup(spec, env_kwargs={"marker": "/nonexistent"}, n_envs=1, steps=4, seed=0)
    server = {"max_batch": 2, "max_wait": 0.01, "device": "cpu"}
    actors = RayActors(setup, GaussianMLPPolicy(spec, hidden=(8,)), n_workers=2, server=server)
    try:
        listed = list_actors(filters=[("ray_namespace", "=", actors.namespace)], timeout=60)
        assert sorted(actor.name for actor in listed) == ["inference-server", "rollout-worker-0", "rollout-worker-1"]
        assert {actor.class_name for actor in listed} == {"RayInferenceServer", "RayRolloutWorker"}
        assert actors.namespace.startswith("uma-rl-")
    finally:
        actors.close()
