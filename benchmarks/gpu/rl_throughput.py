"""RL throughput where the learner has its own device: Humanoid-v5, 14 actor processes, the inference
server and the PPO learner on the GPU, against raw stepping in the same 14 processes, in one run.

    python benchmarks/gpu/rl_throughput.py [--seconds 30] [--repeats 1]
    python benchmarks/gpu/rl_throughput.py --cpu-smoke    # the same code on the CPU: 2 actors, tiny chunks

On the 16-core GPU machine the 14 actors get a core each, and the inference server and the
learner (whose work is on the GPU) the other two, so nothing stepping environments shares its core.
The pipeline is the default recipe (``recipes/rl.yaml``) with ``n_workers: 14`` and
``inference: server``; the ratio is the pipeline's trained env steps/s over raw stepping's (wall
clock, as the cores are the run's own). The goal is 0.9. ``benchmarks/gpu/kernels.py`` runs this
script as one of its sections. Like that script it runs from a checkout without ``pip install``
(it needs gymnasium with MuJoCo); a failure names its check and the script exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACTORS = 14
GOAL = 0.9

if importlib.util.find_spec("uma_lightning") is None:
    sys.path.insert(0, str(REPO))  # a checkout without pip install; actors inherit the path
sys.path.insert(0, str(REPO / "benchmarks"))
import yaml  # noqa: E402
from harness import median, print_table  # noqa: E402
from rl_throughput import pipeline_rate, raw_rate  # noqa: E402


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def gpu_recipe(cpu_smoke: bool) -> dict:
    recipe = yaml.safe_load((REPO / "recipes" / "rl.yaml").read_text())
    data = recipe["data"]["init_args"]
    data.update(inference="server", server_device="cpu" if cpu_smoke else "cuda", n_workers=ACTORS)
    if cpu_smoke:  # 2 actors x 2 envs, 16-step chunks, minibatches that fit them
        data.update(n_workers=2, envs_per_worker=2, steps_per_chunk=16)
        recipe["model"]["init_args"].update(minibatch_size=32, epochs=2)
    return recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="the same code on the CPU: 2 actors x 2 envs, a few seconds"
    )
    parser.add_argument("--env", default="Humanoid-v5")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per variant and repeat")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    seconds = 1.5 if args.cpu_smoke else args.seconds
    started = time.perf_counter()
    section(
        "RL throughput: actors on their own cores, inference server and PPO learner on the "
        + ("CPU (smoke run)" if args.cpu_smoke else "GPU")
    )
    try:
        import torch

        if not args.cpu_smoke and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible (use --cpu-smoke on a machine without one)")
        recipe = gpu_recipe(args.cpu_smoke)
        data = recipe["data"]["init_args"]
        n_workers, n_envs = data["n_workers"], data["envs_per_worker"]
        raw, trained, received = [], [], []
        for repeat in range(args.repeats):
            raw.append(raw_rate(args.env, n_workers, n_envs, seconds)[0])
            rate, got, _ = pipeline_rate(
                recipe,
                args.env,
                seconds,
                skip_iterations=1 if args.cpu_smoke else 3,
                accelerator="cpu" if args.cpu_smoke else "gpu",
            )
            trained.append(rate)
            received.append(got)
            print(
                f"repeat {repeat + 1}: raw {raw[-1]:.0f} env steps/s | pipeline {rate:.0f} trained, {got:.0f} received",
                flush=True,
            )
    except Exception as err:
        traceback.print_exc()
        print(f"FAILED rl throughput: {type(err).__name__}: {err}")
        return 1
    ratio = median(trained) / median(raw)
    print_table(
        f"{args.env}: {n_workers} processes x {n_envs} envs, {seconds:.0f} s per variant, median of {args.repeats}",
        ["variant", "env steps/s", "ratio to raw"],
        [
            ["raw vectorised stepping", median(raw), 1.0],
            ["pipeline, server inference (trained)", median(trained), ratio],
            ["pipeline, server inference (received)", median(received), median(received) / median(raw)],
        ],
    )
    print(
        f"pipeline / raw: {ratio:.3f} (goal {GOAL}){'' if args.cpu_smoke else ' <- below the goal' if ratio < GOAL else ''}"
    )
    print(f"finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
