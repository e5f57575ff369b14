"""Closed-loop success of the tiny pretrain -> midtrain -> posttrain pipeline against a random policy.

Trains the three stages with the shipped recipes through the ``uma`` command (each stage starting
from the previous one's checkpoint), then rolls out on the same held-out simulator scenes:

- the post-trained policy (flow-matching expert, EMA weights) through ``Policy.from_checkpoint``;
- the pre-trained and mid-trained policies (greedy decoding of action tokens), for reference;
- uniform random actions, the baseline to beat; and the scripted expert, the ceiling.

Prints success rates with 95 % Wilson intervals and the mean final distance to the target, then how
much each policy's first actions depend on what it is shown: the camera frame of another scene, another
target named in the instruction, another draw of its sampling noise; beside the change in the expert's
action when the named target changes. A policy that cannot see where its target is cannot succeed.

    python benchmarks/closed_loop.py                        # train everything (about 20 min on 2 CPU cores)
    python benchmarks/closed_loop.py --config configs/vision/grounded.yaml   # the grounded-vision variant (about 35 min)
    python benchmarks/closed_loop.py --episodes 200 --posttrain runs/bench/posttrain/checkpoints
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import print_table  # noqa: E402

from uma_lightning import Policy  # noqa: E402
from uma_lightning.sim.closed_loop import evaluation_seed, random_policy, run_episodes  # noqa: E402
from uma_lightning.sim.planar_arm import PlanarArmEnv  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def train(stage: str, workdir: Path, steps: int, init_from: Path | None, extra: list[str]) -> Path:
    run_dir = workdir / stage
    command = [
        str(Path(sys.executable).parent / "uma"),
        "fit",
        "--config",
        str(REPO / "recipes" / f"{stage}.yaml"),
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.logger",
        "false",
        "--trainer.val_check_interval",
        str(max(steps // 4, 1)),
        *extra,
    ]
    if init_from is not None:
        command += ["--model.init_from", str(init_from)]
    print(f"training {stage}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=workdir)
    print(f"{stage}: {steps} steps in {time.monotonic() - started:.0f}s", flush=True)
    return run_dir / "checkpoints"  # means its newest valid checkpoint


def expert_policy(n_episodes: int, seed: int):
    """The scripted expert on the same scenes, as a ceiling (it acts from the true state)."""
    results = []
    for index in range(n_episodes):
        env = PlanarArmEnv()
        env.reset(seed=evaluation_seed(index, seed))
        done = info = None
        while not done:
            _, _, terminated, truncated, info = env.step(env.expert_action())
            done = terminated or truncated
        results.append((info["success"], env.goal_distance()))
    return results


def input_sensitivity(policy: Policy, n_scenes: int, seed: int) -> dict[str, float]:
    """Mean |change| of the first ``execute`` joint actions on held-out scenes, when one input changes."""
    steps = policy.spec.n_obs_steps

    def observation(obs: dict, image: np.ndarray, instruction: str) -> dict:
        return {
            "images": np.stack([image] * steps)[None, :, None],
            "state": np.stack([obs["state"]] * steps)[None],
            "instruction": [instruction],
        }

    def joint_actions(obs: dict, noise_seed: int = 0) -> np.ndarray:
        torch.manual_seed(noise_seed)
        return policy(obs).numpy()[0, :4, :2]

    changes: dict[str, list[float]] = {
        "camera frame of another scene": [],
        "another target named": [],
        "another sampling-noise seed": [],
        "expert, another target named": [],
    }
    for index in range(n_scenes):
        env, other_env = PlanarArmEnv(), PlanarArmEnv()
        obs, _ = env.reset(seed=evaluation_seed(index, seed))
        other_obs, _ = other_env.reset(seed=evaluation_seed(index + n_scenes, seed))
        other_target = next(t for t in env.targets if t != env.goal)
        named_other = f"reach the {other_target.colour} {other_target.shape}"
        base = joint_actions(observation(obs, obs["image"], obs["instruction"]))
        variants = {
            "camera frame of another scene": joint_actions(observation(obs, other_obs["image"], obs["instruction"])),
            "another target named": joint_actions(observation(obs, obs["image"], named_other)),
            "another sampling-noise seed": joint_actions(
                observation(obs, obs["image"], obs["instruction"]), noise_seed=1
            ),
        }
        for name, actions in variants.items():
            changes[name].append(float(np.abs(actions - base).mean()))
        expert = env.expert_action(noise_std=0.0)[:2]
        env.goal = other_target
        changes["expert, another target named"].append(
            float(np.abs(env.expert_action(noise_std=0.0)[:2] - expert).mean())
        )
    return {name: float(np.mean(values)) for name, values in changes.items()}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/bench")
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="selects the evaluation scenes")
    parser.add_argument("--sensitivity-scenes", type=int, default=50, help="scenes of the input-sensitivity table")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--midtrain-steps", type=int, default=200)
    parser.add_argument("--posttrain-steps", type=int, default=1000)
    parser.add_argument("--pretrain", type=Path, help="use this pretraining checkpoint instead of training")
    parser.add_argument("--midtrain", type=Path, help="use this mid-training checkpoint instead of training")
    parser.add_argument("--posttrain", type=Path, help="use this post-training checkpoint instead of training")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        type=Path,
        help="a config fragment added to every stage, e.g. configs/vision/grounded.yaml",
    )
    parser.add_argument(
        "--stage-args",
        default="",
        help="more uma fit arguments for every stage, e.g. \"--model.vision '{tokenizer: keypoints}'\"",
    )
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    extra = [arg for fragment in args.config for arg in ("--config", str(fragment.resolve()))] + shlex.split(
        args.stage_args
    )
    pretrain = args.pretrain or train("pretrain", workdir, args.pretrain_steps, None, extra)
    midtrain = args.midtrain or train("midtrain", workdir, args.midtrain_steps, pretrain, extra)
    posttrain = args.posttrain or train("posttrain", workdir, args.posttrain_steps, midtrain, extra)

    rows, sensitivity = [], {}
    candidates = [
        ("post-trained (flow matching, EMA)", posttrain),
        ("mid-trained (action tokens)", midtrain),
        ("pre-trained (action tokens)", pretrain),
    ]
    for name, checkpoint in candidates:
        policy = Policy.from_checkpoint(str(checkpoint))
        execute = max(policy.spec.action_horizon // 2, 1)
        torch.manual_seed(args.seed)
        started = time.monotonic()
        results = run_episodes(
            lambda obs: policy(obs).numpy(),
            list(range(args.episodes)),
            policy.spec.n_obs_steps,
            execute,
            seed=args.seed,
        )
        outcomes = [(r.success, r.goal_distance) for r in results]
        rows.append(
            (
                name,
                outcomes,
                f"{policy.spec.action_horizon}-step chunks, {execute} executed, {time.monotonic() - started:.0f}s",
            )
        )
        sensitivity[name] = input_sensitivity(policy, args.sensitivity_scenes, args.seed)
    random_act = random_policy(16, 3, seed=args.seed)
    rows.append(
        (
            "random actions",
            [
                (r.success, r.goal_distance)
                for r in run_episodes(random_act, list(range(args.episodes)), 1, 8, seed=args.seed)
            ],
            "uniform in [-1, 1]",
        )
    )
    rows.append(("scripted expert", expert_policy(args.episodes, args.seed), "acts from the true target position"))

    table = []
    for name, outcomes, note in rows:
        successes = sum(ok for ok, _ in outcomes)
        low, high = wilson(successes, len(outcomes))
        distance = float(np.mean([d for _, d in outcomes]))
        table.append(
            [
                name,
                f"{successes}/{len(outcomes)}",
                f"{100 * successes / len(outcomes):.1f}%",
                f"{100 * low:.1f}-{100 * high:.1f}%",
                f"{distance:.3f}",
                note,
            ]
        )
    print_table(
        f"closed-loop success on {args.episodes} held-out planar-arm scenes (seed {args.seed})",
        ["policy", "successes", "rate", "95% interval", "final distance", "notes"],
        table,
    )
    changed = list(next(iter(sensitivity.values())))
    print_table(
        f"mean |change| of the first 4 predicted joint actions (robot units) on {args.sensitivity_scenes} held-out scenes when one input changes",
        ["policy", *changed],
        [[name, *(f"{values[key]:.4f}" for key in changed)] for name, values in sensitivity.items()],
    )


if __name__ == "__main__":
    main()
