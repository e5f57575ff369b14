"""Framework overhead: `uma fit` step time against a hand-written PyTorch loop on the same model and batches.

Both sides build the model from the same config and seed, iterate the same data loader (same
batches, same order, same worker count), clip gradients and step AdamW with the same schedule, on
the same number of threads. `uma fit` runs the real pretrain recipe: progress log, throughput,
MLflow logging and checkpointing included. Step time is the wall time between consecutive step
ends, data wait included; the rounds alternate and the ratio is of medians.

    python benchmarks/framework_overhead.py [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from harness import median, print_table

from uma_lightning.cli import UmaCLI
from uma_lightning.data import RobotDataModule
from uma_lightning.modules import OptimizerConfig, PretrainModule

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "pretrain.yaml")
STEP_ENDS: list[float] = []


class StepTimer(L.Callback):
    def on_train_batch_end(self, *args) -> None:
        STEP_ENDS.append(time.perf_counter())


def uma_fit_step_times(steps: int, workdir: Path) -> list[float]:
    STEP_ENDS.clear()
    UmaCLI(
        [
            "fit",
            "--config",
            RECIPE,
            "--trainer.max_steps",
            str(steps),
            "--trainer.default_root_dir",
            str(workdir / "run"),
            "--trainer.logger.init_args.store_dir",
            str(workdir / "mlruns"),
            "--trainer.callbacks+=__main__.StepTimer",
        ]
    )
    return [b - a for a, b in zip(STEP_ENDS, STEP_ENDS[1:])]


def plain_loop_step_times(steps: int) -> list[float]:
    """The same training as the recipe, written the way a researcher would without a framework."""
    torch.manual_seed(0)
    data = RobotDataModule()  # the recipe's data settings are this module's defaults
    data.setup("fit")
    module = PretrainModule(spec=data.spec, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=30))
    model = module.build_model()
    module.model = model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    cfg = module.optimizer_config
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min((step - cfg.warmup_steps) / max(steps - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    ends = []
    model.train()
    for step, batch in enumerate(data.train_dataloader()):
        if step == steps:
            break
        loss = module.compute_loss(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.argv = sys.argv[:1]  # the CLI under test must not see this script's flags
    rows, plain_all, uma_all = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            plain = plain_loop_step_times(args.steps)
            uma = uma_fit_step_times(args.steps, Path(tmp) / f"round{round_index}")
            plain_all += plain
            uma_all += uma
            rows.append([round_index, median(plain) * 1e3, median(uma) * 1e3, median(uma) / median(plain)])
    rows.append(["all", median(plain_all) * 1e3, median(uma_all) * 1e3, median(uma_all) / median(plain_all)])
    print_table(
        f"framework overhead, tiny model, {args.steps} steps per round, {torch.get_num_threads()} threads",
        ["round", "plain loop ms/step", "uma fit ms/step", "ratio"],
        rows,
    )


if __name__ == "__main__":
    main()
