"""Test-only Lightning pieces for the resume tests: a module whose loss draws from every random generator,
recorders that write what each step saw, injected faults, a hostile pickle, and the recipe that puts them together."""

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback, LightningModule
from suite import RECIPE, TINY

from uma_lightning.callbacks import ExpertLoad
from uma_lightning.modules import PretrainModule
from uma_lightning.parallel.pipeline import pipeline_of

MAX_STEPS = 22  # the resume recipe's


class NoisyPretrain(PretrainModule):
    """Draws from torch, numpy and python random in every step, like dropout or noise augmentation would:
    a resumed run matches only if every generator is restored."""

    def compute_loss(self, batch):
        out = super().compute_loss(batch)
        if self.training:
            out["loss"] = out["loss"] + 1e-3 * (torch.rand(()) + float(np.random.rand()) + random.random())
        return out


class LinearRegression(LightningModule):
    """The smallest module a Trainer fits: one linear layer, eight batches of one sample."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=1)


class RunsCommand:
    """Unpickling it runs ``touch <marker>``: what a hostile checkpoint index would hold."""

    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class RecordSteps(Callback):
    """Appends ``{"step", "loss", "samples"}`` per optimizer step to ``<dir>/steps-rank<r>.jsonl``, and
    under pipeline parallelism the step's ``bubble`` (what StepTimeBreakdown logs)."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"step": trainer.global_step, "loss": outputs["loss"].item(), "samples": batch["sample_id"].tolist()}
        pipeline = pipeline_of(pl_module)
        if pipeline is not None:
            record["bubble"] = pipeline.bubble_fraction
        with open(self.dir / f"steps-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")


class RecordExpertMetrics(ExpertLoad):
    """Rank 0 appends ``{"step", "metrics"}`` per step, the metrics ExpertLoad logs, to ``<dir>/moe.jsonl``."""

    def __init__(self, dir: str):
        super().__init__()
        self.dir = Path(dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = self.step_metrics(trainer, pl_module)
        if trainer.is_global_zero:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / "moe.jsonl", "a") as file:
                file.write(json.dumps({"step": trainer.global_step, "metrics": metrics}) + "\n")


def recorded_steps(dir: Path, rank: int = 0) -> list[dict]:
    path = Path(dir) / f"steps-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class CrashAt(Callback):
    """Raises after optimizer step ``step``, as a crash would, at most once per marker file."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash after step {self.step} (pid {os.getpid()})")


class StallAfter(Callback):
    """Makes the step after ``step`` take ``seconds`` (a hung collective, a stuck filesystem)."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            import sys
            import time

            print(f"stalling after step {self.step}", file=sys.stderr, flush=True)  # a test may wait for this line
            time.sleep(self.seconds)


class RollbackAt(Callback):
    """Rolls back to the newest checkpoint after optimizer step ``step`` and keeps what it saw."""

    def __init__(self, step: int):
        self.step = step
        self.rolled_back_to = None
        self.weights_after = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.rolled_back_to = trainer.checkpoint_callback.rollback(trainer, pl_module)
            self.weights_after = {k: v.clone() for k, v in pl_module.state_dict().items()}


# Post-training's flow model, small, trained from scratch, with its EMA.
TINY_POSTTRAIN = {
    "class_path": "uma_lightning.modules.PosttrainModule",
    "init_args": {"network": {"size": TINY}, "expert": {"dim": 32, "ffn_dim": 64}, "init_from": None},
}


def resume_recipe(
    path: Path,
    record_dir: Path,
    extra_callbacks=(),
    every_n_steps: int = 4,
    trainer: dict | None = None,
    base: str = RECIPE,
    model: dict | None = None,
) -> str:
    """A recipe for the resume tests: ``base`` with ``model`` (NoisyPretrain by default), deterministic,
    checkpoints every ``every_n_steps``, each step recorded to ``record_dir``; ``trainer`` overrides trainer keys."""
    recipe = {
        "include": [base],
        "model": model or {"class_path": "checkpoint_modules.NoisyPretrain", "init_args": {"network": {"size": TINY}}},
        "trainer": {
            "logger": False,
            "deterministic": True,
            "max_steps": MAX_STEPS,
            # With an epoch limit, the LR schedule's estimated_stepping_batches builds the train loader
            # before the checkpoint is restored (the path that needs the loader rebuilt).
            "max_epochs": 5,
            "val_check_interval": 5,
            "limit_val_batches": 2,
            "callbacks": [
                {
                    "class_path": "uma_lightning.callbacks.ShardedCheckpoint",
                    "init_args": {"every_n_steps": every_n_steps, "keep_last": 2},
                },
                {"class_path": "checkpoint_modules.RecordSteps", "init_args": {"dir": str(record_dir)}},
                *extra_callbacks,
            ],
            **(trainer or {}),
        },
    }
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def crash_at(step: int) -> dict:
    """The recipe entry of a ``CrashAt`` callback."""
    return {"class_path": "checkpoint_modules.CrashAt", "init_args": {"step": step}}


class SaveWeightsAtStart(Callback):
    """Rank 0 saves every parameter and MoE balancing bias, whole (gathered from shards and pipeline
    stages), to ``path`` when training starts: after a checkpoint has been restored, before the first step."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        from uma_lightning.tools.parity.recorded_runs import full_expert_biases, full_parameters

        weights = {**full_parameters(pl_module), **full_expert_biases(pl_module)}
        if trainer.is_global_zero:
            torch.save(weights, self.path)
