"""Logging a callback's metrics on the same step axis as Lightning's own ``self.log`` metrics."""

from __future__ import annotations

from typing import Optional

from lightning.pytorch import Trainer

from uma_lightning.lightning_compat import log_step


def log_step_metrics(trainer: Trainer, metrics: dict[str, float], step: Optional[int] = None) -> None:
    """Sends ``metrics`` straight to the trainer's loggers from global rank zero, at ``step`` or the
    current batch's step. Unlike ``LightningModule.log``, a value logged once is not repeated at
    later steps, and a value measured late (a CUDA event) can go to the step it belongs to."""
    if trainer.is_global_zero:
        step = log_step(trainer) if step is None else step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
