"""Rolling a running fit back to its last checkpoint, without restarting the process.

Only these two functions know the checkpoint's layout: today the file ModelCheckpoint writes as
``<run dir>/checkpoints/last.ckpt``. Another checkpoint format replaces them and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


def last_checkpoint(trainer: Trainer) -> Optional[Path]:
    """The newest complete checkpoint of this fit, or None before the first one is written."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            if path.is_file():
                return path
    return None


def restore_training_state(trainer: Trainer, path: Path) -> int:
    """Loads model weights, optimizer and LR-scheduler state, the precision plugin's state (a loss
    scaler) and the optimizer-step counter from ``path``; returns the restored global step.

    The data loader is left where it is: training continues with the next batch, so the batches
    between the checkpoint and now are not replayed.
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    trainer.strategy.load_model_state_dict(checkpoint, strict=True)
    trainer.strategy.load_optimizer_state_dict(checkpoint)
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    precision_state = checkpoint.get(type(trainer.precision_plugin).__qualname__)
    if precision_state:
        trainer.precision_plugin.load_state_dict(precision_state)
    step = int(checkpoint["global_step"])
    # trainer.global_step reads this counter (automatic optimization), and max_steps is checked against it.
    counter = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    counter.ready = counter.completed = step
    return step
