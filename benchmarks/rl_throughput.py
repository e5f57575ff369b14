"""Environment steps per second through the whole actor-learner pipeline, against raw vectorised
stepping of the same environments in the same number of processes, measured in one run.

    python benchmarks/rl_throughput.py [--env Humanoid-v5] [--seconds 60] [--repeats 2]
    python benchmarks/rl_throughput.py --cpu-time [--seconds 20] [--repeats 5] [--json FILE] [--envs-per-worker 16]
    python benchmarks/rl_throughput.py --breakdown [--repeats 16] [--envs-per-worker 16]

raw:       N processes, each stepping a gymnasium SyncVectorEnv of M environments with random actions.
pipeline:  the default recipe (recipes/rl.yaml: PPO, N workers x M envs, asynchronous) trained by the
           Lightning Trainer; counts only env steps the learner trained on (dropped stale chunks excluded),
           after the first iterations (start-up excluded).

The two alternate, ``--repeats`` times each; the table shows medians and the ratio pipeline / raw.
On a shared machine wall-clock rates follow the load, so the table also shows CPU seconds per 1000
env steps of every process involved (workers and learner): raw / pipeline of that is the throughput
ratio on cores of one's own.

``--cpu-time`` measures the actors alone: CPU time per env step of the recipe's worker processes
(local inference, a learner that only takes chunks and publishes a version per iteration) against
raw stepping's, alternating the two. It counts process CPU time, not wall time, so a busy machine
changes little; ``--json FILE`` writes the medians and ``actor_cpu_per_step_vs_raw``.

``--breakdown`` shows where that CPU goes, in one process that fills chunks as an actor does, times
acting and env stepping apart, and steps raw and replays the same actions through ``EnvVector``
between chunks, so that all see the same load (``--repeats`` chunks).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median, print_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _raw_worker(env: str, n_envs: int, seconds: float, seed: int, out) -> None:
    from uma_lightning.rl.env import make_vector_env

    envs = make_vector_env(env, None, n_envs)
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    for _ in range(20):  # warm-up
        envs.step(envs.action_space.sample())
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        envs.step(envs.action_space.sample())
        steps += n_envs
    out.put((steps, time.perf_counter() - start, time.process_time() - cpu))


def raw_rate(env: str, n_workers: int, n_envs: int, seconds: float) -> tuple[float, float]:
    """(sum over processes of env steps/s, all stepping at the same time; CPU seconds per 1000 env steps)."""
    from uma_lightning.rl.local import process_context

    ctx = process_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_raw_worker, args=(env, n_envs, seconds, 1000 * i, out)) for i in range(n_workers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    steps = sum(r[0] for r in results)
    return sum(r[0] / r[1] for r in results), 1000 * sum(r[2] for r in results) / steps


def _cpu_seconds() -> float:
    """CPU time of this process and all its children (actor workers, forkserver)."""
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def _process_cpu(pid: int) -> float:
    import psutil

    return sum(psutil.Process(pid).cpu_times()[:2])


def actor_cpu_per_step(
    env: str, n_workers: int, n_envs: int, steps_per_chunk: int, hidden: list[int], seconds: float, skip_chunks: int = 2
) -> float:
    """CPU milliseconds per env step of rollout workers with local inference (``GaussianMLPPolicy``, the
    recipe's hidden sizes). Each worker's CPU is read when its chunks arrive, after the first
    ``skip_chunks`` (start-up), so the part of the next chunk a worker has begun is in both readings."""
    from uma_lightning.rl.env import probe_env
    from uma_lightning.rl.local import ActorSetup, LocalActors
    from uma_lightning.rl.policy import GaussianMLPPolicy

    spec = probe_env(env)
    policy = GaussianMLPPolicy(spec, tuple(hidden))
    actors = LocalActors(ActorSetup(spec, n_envs=n_envs, steps=steps_per_chunk), policy, n_workers, slots_per_worker=1)
    try:
        version, received, marks = 0, [0] * n_workers, {}
        actors.publish(policy.state_dict(), version)
        start = None
        while start is None or time.perf_counter() - start < seconds or len(marks) < n_workers:
            chunk = actors.next_chunk(timeout=300)
            received[chunk.worker] += 1
            if received[chunk.worker] > skip_chunks:
                cpu = _process_cpu(actors.pids[chunk.worker])
                first = marks.get(chunk.worker, (cpu, received[chunk.worker]))[:2]
                marks[chunk.worker] = (*first, cpu, received[chunk.worker])
                start = start or time.perf_counter()
            if sum(received) % n_workers == 0:  # one learner iteration: a new version, as training publishes
                version += 1
                actors.publish(policy.state_dict(), version)
        if actors.restarts:
            raise RuntimeError(f"{actors.restarts} actor restart(s) during the measurement")
    finally:
        actors.close()
    cpu = sum(last - first for first, _, last, _ in marks.values())
    chunks = sum(n_last - n_first for _, n_first, _, n_last in marks.values())
    return 1000 * cpu / (chunks * n_envs * steps_per_chunk)


def cpu_time_main(args, recipe: dict) -> None:
    data = recipe["data"]["init_args"]
    n_workers, n_envs, steps = (
        data["n_workers"],
        args.envs_per_worker or data["envs_per_worker"],
        data.get("steps_per_chunk", 64),
    )
    hidden = recipe["model"]["init_args"].get("hidden", [64, 64])
    raw, actor = [], []
    for repeat in range(args.repeats):
        raw.append(raw_rate(args.env, n_workers, n_envs, args.seconds)[1])
        actor.append(actor_cpu_per_step(args.env, n_workers, n_envs, steps, hidden, args.seconds))
        print(
            f"repeat {repeat + 1}: raw {raw[-1]:.4f} ms CPU / env step | actor {actor[-1]:.4f} ms | "
            f"ratio {actor[-1] / raw[-1]:.3f}",
            flush=True,
        )
    ratios = [a / r for a, r in zip(actor, raw)]
    print_table(
        f"{args.env}: {n_workers} processes x {n_envs} envs, local inference, {args.seconds:.0f} s per variant, median of {args.repeats}",
        ["variant", "CPU ms / env step", "ratio to raw"],
        [
            ["raw vectorised stepping", median(raw), 1.0],
            ["actor (policy, bookkeeping, chunk writes)", median(actor), median(ratios)],
        ],
    )
    if args.json:
        result = {
            "env": args.env,
            "n_workers": n_workers,
            "envs_per_worker": n_envs,
            "repeats": args.repeats,
            "raw_cpu_ms_per_step": median(raw),
            "actor_cpu_ms_per_step": median(actor),
            "actor_cpu_per_step_vs_raw": median(ratios),
            "ratios": ratios,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def breakdown_main(args, recipe: dict) -> None:
    """Where an actor's CPU goes, in this one process: chunks filled by an ``EnvRunner`` with a
    ``PolicyActor`` (the recipe's policy, its acting and env stepping timed apart), each followed by as
    many steps of raw stepping and by the same clipped actions replayed through an ``EnvVector``, so
    that all three see the same load. Thread CPU time, medians over chunks."""
    import numpy as np
    import torch

    from uma_lightning.rl.env import EnvVector, make_vector_env, probe_env
    from uma_lightning.rl.policy import GaussianMLPPolicy
    from uma_lightning.rl.rollout import EnvRunner, PolicyActor, chunk_layout

    torch.set_num_threads(1)
    n_envs, steps = args.envs_per_worker or recipe["data"]["init_args"]["envs_per_worker"], 128
    spec = probe_env(args.env)
    runner = EnvRunner(spec, None, n_envs, seed=0, return_discount=0.99)
    actor = PolicyActor(GaussianMLPPolicy(spec, tuple(recipe["model"]["init_args"].get("hidden", [64, 64]))), version=0)
    spent = {"policy": 0, "env": 0}

    def timed(name: str, fn):
        def call(*fn_args):
            start = time.thread_time_ns()
            result = fn(*fn_args)
            spent[name] += time.thread_time_ns() - start
            return result

        return call

    runner.envs.step = timed("env", runner.envs.step)
    act = timed("policy", actor)
    raw = make_vector_env(args.env, None, n_envs)
    raw.reset(seed=0)
    raw.action_space.seed(0)
    replay = EnvVector(args.env, None, n_envs)
    replay_obs = np.empty((n_envs, spec.obs_dim), np.float32)
    replay_out = (replay_obs.copy(), np.empty(n_envs), np.empty(n_envs, bool), np.empty(n_envs, bool))
    replay.reset(list(range(n_envs)), replay_obs)
    chunk = {
        name: torch.empty(shape, dtype=dtype).numpy()
        for name, (shape, dtype) in chunk_layout(spec, steps, n_envs).items()
    }
    rows = {name: [] for name in ("raw", "actor", "policy", "env", "rest", "replay")}
    for index in range(args.repeats + 1):  # the first is a warm-up
        spent.update(policy=0, env=0)
        start = time.thread_time_ns()
        runner.fill(chunk, act)
        actor_ns = time.thread_time_ns() - start
        start = time.thread_time_ns()
        for _ in range(steps):
            raw.step(raw.action_space.sample())
        raw_ns = time.thread_time_ns() - start
        actions = np.clip(chunk["action"], runner.low, runner.high)
        start = time.thread_time_ns()
        for t in range(steps):
            replay.step(actions[t], replay_obs, *replay_out)
        replay_ns = time.thread_time_ns() - start
        if index:
            for name, ns in (
                ("raw", raw_ns),
                ("actor", actor_ns),
                ("policy", spent["policy"]),
                ("env", spent["env"]),
                ("rest", actor_ns - spent["policy"] - spent["env"]),
                ("replay", replay_ns),
            ):
                rows[name].append(ns / steps / 1000)
    raw_us = median(rows["raw"])
    print_table(
        f"{args.env}: one process, {n_envs} envs, {args.repeats} chunks of {steps} steps each way, interleaved",
        ["part", "CPU us / batch step", "ratio to raw"],
        [
            ["raw vectorised stepping (SyncVectorEnv, random actions)", raw_us, 1.0],
            ["actor: EnvRunner.fill", median(rows["actor"]), median(a / r for a, r in zip(rows["actor"], rows["raw"]))],
            ["  of which acting (PolicyActor)", median(rows["policy"]), median(rows["policy"]) / raw_us],
            ["  of which env steps (EnvVector)", median(rows["env"]), median(rows["env"]) / raw_us],
            ["  of which the rest (clipping, chunk bookkeeping)", median(rows["rest"]), median(rows["rest"]) / raw_us],
            ["EnvVector, the actor's actions replayed", median(rows["replay"]), median(rows["replay"]) / raw_us],
        ],
    )
    runner.close()
    raw.close()
    replay.close()


def pipeline_rate(
    recipe: dict, env: str, seconds: float, skip_iterations: int = 3, accelerator: str = "cpu"
) -> tuple[float, float, float]:
    """(trained env steps/s, received env steps/s, CPU seconds per 1000 trained env steps) of the
    recipe's learner and data module, the learner on ``accelerator``."""
    import lightning as L
    from lightning.pytorch import Callback

    from uma_lightning.rl import PPOLearner, RolloutDataModule

    class Clock(Callback):
        def __init__(self):
            self.marks: list[tuple[float, int, int, float]] = []

        def on_train_epoch_end(self, trainer, pl_module):
            data = trainer.datamodule
            chunk = data.hparams.envs_per_worker * data.hparams.steps_per_chunk
            self.marks.append(
                (time.perf_counter(), data.env_steps - data.dropped_chunks * chunk, data.env_steps, _cpu_seconds())
            )
            if len(self.marks) > skip_iterations and self.marks[-1][0] - self.marks[skip_iterations][0] >= seconds:
                trainer.should_stop = True

    data_args = dict(recipe["data"]["init_args"], env=env, total_env_steps=10**9)
    data = RolloutDataModule(**data_args)
    model = PPOLearner(env=data.env_spec, **recipe["model"]["init_args"])
    clock = Clock()
    trainer = L.Trainer(
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
        accelerator=accelerator,
        devices=1,
    )
    trainer.fit(model, data)
    (t0, trained0, received0, cpu0), (t1, trained1, received1, cpu1) = clock.marks[skip_iterations], clock.marks[-1]
    return (
        (trained1 - trained0) / (t1 - t0),
        (received1 - received0) / (t1 - t0),
        1000 * (cpu1 - cpu0) / (trained1 - trained0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Humanoid-v5")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "rl.yaml"))
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per variant and repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="actor CPU per env step against raw stepping's")
    parser.add_argument("--envs-per-worker", type=int, help="with --cpu-time: envs per worker instead of the recipe's")
    parser.add_argument("--json", help="with --cpu-time: write the medians and actor_cpu_per_step_vs_raw to this file")
    parser.add_argument(
        "--breakdown", action="store_true", help="where an actor's CPU goes, in one process (--repeats chunks)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    if args.cpu_time:
        cpu_time_main(args, recipe)
        return
    if args.breakdown:
        breakdown_main(args, recipe)
        return
    n_workers, n_envs = recipe["data"]["init_args"]["n_workers"], recipe["data"]["init_args"]["envs_per_worker"]

    raw, raw_cpu, trained, received, cpu = [], [], [], [], []
    for repeat in range(args.repeats):
        rate, seconds_per_k = raw_rate(args.env, n_workers, n_envs, args.seconds)
        raw.append(rate)
        raw_cpu.append(seconds_per_k)
        t, r, c = pipeline_rate(recipe, args.env, args.seconds)
        trained.append(t)
        received.append(r)
        cpu.append(c)
        print(
            f"repeat {repeat + 1}: raw {rate:.0f} env steps/s ({seconds_per_k:.2f} CPU s / 1000) | pipeline {t:.0f} trained, "
            f"{r:.0f} received env steps/s ({c:.2f} CPU s / 1000)",
            flush=True,
        )
    print_table(
        f"{args.env}: {n_workers} processes x {n_envs} envs, {args.seconds:.0f} s per variant, median of {args.repeats}",
        ["variant", "env steps/s", "ratio to raw", "CPU s / 1000 steps", "CPU ratio (raw / variant)"],
        [
            ["raw vectorised stepping", median(raw), 1.0, median(raw_cpu), 1.0],
            [
                "actor-learner pipeline (trained)",
                median(trained),
                median(trained) / median(raw),
                median(cpu),
                median(raw_cpu) / median(cpu),
            ],
            ["actor-learner pipeline (received)", median(received), median(received) / median(raw), "", ""],
        ],
    )


if __name__ == "__main__":
    main()
