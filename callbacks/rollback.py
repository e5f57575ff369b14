"""Rolling a running fit back to its newest checkpoint, without restarting the process.

The checkpoint is the run's ``ShardedCheckpoint``: it puts back the weights, optimizer, LR
schedulers and loss scaler; this adds the optimizer-step counter, so the steps since the checkpoint
are trained again (with other batches: the data loader goes on where it is).
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch import LightningModule, Trainer

from uma_lightning.callbacks.checkpointing import ShardedCheckpoint


def roll_back(trainer: Trainer, pl_module: LightningModule) -> Optional[int]:
    """Restore the newest valid checkpoint on every rank; its step, or None when there is none yet
    (or the run saves no sharded checkpoints)."""
    checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ShardedCheckpoint)), None)
    step = checkpoint.rollback(trainer, pl_module) if checkpoint is not None else None
    if step is not None:
        # trainer.global_step reads this counter (automatic optimization), and max_steps is checked against it.
        counter = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        counter.ready = counter.completed = step
    return step
