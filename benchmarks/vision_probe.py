"""How fast the robot model learns to locate things from its camera: a probe for the vision pathway.

A policy of the planar-arm task must find the named target in the frame; one that cannot, ignores the
camera (see the input-sensitivity table of closed_loop.py). This trains the tiny model's tokenizers and
backbone, with a linear head on the last prefix token, to regress a world position from the frame and
the instruction, on fresh simulator scenes every step (no data is reused, so this measures learning,
not memorising). Two targets:

- the end effector: one salient object, no language needed;
- the named target: the object the instruction names, among 3 or 4 coloured shapes.

Each image tokenizer (``VisionConfig``: patches, keypoints, keypoints conditioned on the instruction
by FiLM) is probed on each target. It prints the
held-out mean squared error over the targets' variance at intervals: 1 means nothing was learned
beyond the mean position, 0 a perfect localisation.

    python benchmarks/vision_probe.py [--steps 300] [--lr 1e-3] [--tokenizers keypoints_film] [--targets 'named target']
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import print_table  # noqa: E402

from uma_lightning.data.spec import DataSpec  # noqa: E402
from uma_lightning.models import RobotModelConfig, RobotTransformer, VisionConfig, load_size  # noqa: E402
from uma_lightning.sim.planar_arm import PlanarArmEnv  # noqa: E402

TOKENIZERS = {
    "patches": VisionConfig(),
    "keypoints": VisionConfig(tokenizer="keypoints"),
    "keypoints_film": VisionConfig(tokenizer="keypoints", film=True),
}
TARGETS = {
    "end effector": lambda env: env.arm_points()[2],
    "named target": lambda env: np.asarray(env.goal.position),
}


def scenes(first_seed: int, n: int, target: str) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    env = PlanarArmEnv()
    frames, instructions, positions = [], [], []
    for seed in range(first_seed, first_seed + n):
        obs, _ = env.reset(seed=seed)
        frames.append(obs["image"])
        instructions.append(obs["instruction"])
        positions.append(TARGETS[target](env))
    return torch.as_tensor(np.stack(frames)), instructions, torch.as_tensor(np.stack(positions), dtype=torch.float32)


def probe(target: str, tokenizer: str, steps: int, lr: float, batch_size: int, every: int) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    env = PlanarArmEnv()
    spec = DataSpec(
        cameras=("top",),
        image_size=(env.config.image_size,) * 2,
        state_dim=env.state_dim,
        action_dim=env.action_dim,
        n_obs_steps=1,
        action_horizon=8,
        fps=env.fps,
    )
    model = RobotTransformer(RobotModelConfig(backbone=load_size("tiny"), spec=spec, vision=TOKENIZERS[tokenizer]))
    head = torch.nn.Linear(model.cfg.backbone.dim, 2)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=lr)

    def loss_of(frames, instructions, positions):
        text_ids, text_mask = model.text_tokenizer(instructions)
        images = frames[:, None, None]  # one step, one camera
        state = torch.zeros(len(frames), 1, spec.state_dim)  # the probe must read positions from pixels
        hidden, _ = model.encode_prefix(images, state, text_ids, text_mask)
        return (head(hidden[:, -1]) - positions).pow(2).mean()

    held_out = scenes(10**6, 256, target)
    variance = held_out[2].var(0).mean().item()
    curve = []
    for step in range(steps + 1):
        if step % every == 0:
            with torch.no_grad():
                curve.append((step, loss_of(*held_out).item() / variance))
        if step < steps:
            loss = loss_of(*scenes(step * batch_size, batch_size, target))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=list(TOKENIZERS))
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    args = parser.parse_args()
    curves = {}
    for target in args.targets:
        for tokenizer in args.tokenizers:
            started = time.monotonic()
            curves[f"{target} ({tokenizer})"] = probe(
                target, tokenizer, args.steps, args.lr, args.batch_size, args.every
            )
            print(f"{target}, {tokenizer}: {args.steps} steps in {time.monotonic() - started:.0f}s", flush=True)
    steps = [step for step, _ in next(iter(curves.values()))]
    print_table(
        f"held-out MSE / variance of the position, tiny model, batch {args.batch_size}, lr {args.lr} (1: nothing learned)",
        ["step", *curves],
        [[step, *(f"{dict(curve)[step]:.3f}" for curve in curves.values())] for step in steps],
    )


if __name__ == "__main__":
    main()
