"""Sharded checkpoints of the whole training state every N steps, and automatic resume.

Rerunning the same command with the same run directory continues from the newest valid checkpoint
in ``<run dir>/checkpoints``: model, optimizer, schedulers, loop progress, data position, callback
states and the random state of every rank, so the continued run computes exactly what the
uninterrupted one would have. A checkpoint that fails verification (unfinished or corrupt) is
reported and the one before it is used. The formats and the writing are in ``uma_lightning.checkpoint``.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

from uma_lightning.checkpoint import (
    CheckpointWriter,
    RunFinished,
    check_resumable,
    choose_checkpoint,
    continue_tracked_run,
    finish_tracked_run,
    remove_staging_leftovers,
    rng,
    run_identity,
)
from uma_lightning.checkpoint.state import TRAINER, apply_trainer_state, collect, load
from uma_lightning.ranks import random_stream_rank

log = logging.getLogger("uma_lightning")


class ShardedCheckpoint(Checkpoint):
    def __init__(
        self,
        dirpath: Optional[str] = None,
        every_n_steps: int = 100,
        keep_last: int = 2,
        keep_every_n_steps: Optional[int] = None,
        async_save: bool = True,
        resume: bool = True,
        save_last: bool = True,
    ):
        """
        Args:
            dirpath: Checkpoints directory; None uses ``<trainer.default_root_dir>/checkpoints``.
            every_n_steps: Save after every this many optimizer steps.
            keep_last: Keep this many newest checkpoints; older ones are deleted.
            keep_every_n_steps: Also keep, for good, checkpoints whose step is a multiple of this.
            async_save: Write in the background; training is blocked only while the state is copied
                to host memory, and that copy overlaps the next forward and backward pass. A
                synchronous save commits at once, before its step's metrics are logged.
            resume: Continue from the newest valid checkpoint in ``dirpath`` when there is one.
            save_last: Also save when training ends.
        """
        for name, value in (("every_n_steps", every_n_steps), ("keep_last", keep_last)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if keep_every_n_steps is not None and keep_every_n_steps < 1:
            raise ValueError(f"keep_every_n_steps must be >= 1 or None, got {keep_every_n_steps}")
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.keep_every_n_steps = keep_every_n_steps
        self.async_save = async_save
        self.resume = resume
        self.save_last = save_last
        self.resumed_from: Optional[Path] = None
        self._writer: Optional[CheckpointWriter] = None
        self._group: Optional[dist.ProcessGroup] = None
        self._saved_rng: Optional[dict] = None
        self._last_saved_step: Optional[int] = None
        self._step_seen: Optional[int] = None
        self._commit_gate: Optional[threading.Event] = None
        self._identity: Optional[dict] = None

    def check_resumable(self, trainer: Trainer, module: LightningModule, datamodule) -> None:
        """Refuse to resume another run's checkpoints (CheckpointError), or a run that already reached
        ``max_steps`` (RunFinished). Before anything is written, so the CLI calls it before fitting starts."""
        if self.resume and self.dirpath is not None:
            try:
                check_resumable(Path(self.dirpath), run_identity(module, datamodule), trainer.max_steps)
            except RunFinished:
                finish_tracked_run(trainer.loggers, Path(self.dirpath))  # if a kill kept it from finishing
                raise

    def continue_tracked_run(self, trainer: Trainer) -> None:
        """Point the MLflow logger at the run of the checkpoint that will be resumed. Must happen before
        anything logs, so the CLI calls it before fitting starts."""
        if self.resume and self.dirpath is not None:
            continue_tracked_run(trainer.loggers, Path(self.dirpath))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:
            self.dirpath = str(Path(trainer.default_root_dir).resolve() / "checkpoints")
        root = Path(self.dirpath)
        self._identity = run_identity(pl_module, trainer.datamodule)
        if self.resume:  # what `uma fit` checked already; a plain Lightning script is checked here
            check_resumable(root, self._identity)
        if trainer.world_size > 1:
            # The background writer's own group: its collectives never meet the training thread's.
            self._group = dist.new_group(backend="gloo")
        if trainer.is_global_zero:
            root.mkdir(parents=True, exist_ok=True)
            remove_staging_leftovers(root)
        if self._group is not None:
            dist.barrier(group=self._group)
        self._writer = CheckpointWriter(root, self.keep_last, self.keep_every_n_steps, self.async_save, self._group)
        if self.resume:
            self.resumed_from = choose_checkpoint(root, self._group)
            self.continue_tracked_run(trainer)
        if trainer.is_global_zero:
            retention = f"keeping the newest {self.keep_last}" + (
                f" and every {self.keep_every_n_steps}th step" if self.keep_every_n_steps else ""
            )
            log.info(
                "checkpoints: %s every %d steps to %s, %s; %s",
                "async" if self.async_save else "synchronous",
                self.every_n_steps,
                root,
                retention,
                f"resuming from {self.resumed_from.name}" if self.resumed_from else "starting fresh",
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.resumed_from is None:
            return
        trainer_state, self._saved_rng = load(trainer, pl_module, self.resumed_from, self._group)
        apply_trainer_state(trainer, pl_module, trainer_state)
        self._last_saved_step = trainer.global_step
        if trainer.is_global_zero:
            log.info(
                "resumed from %s: step %d, epoch %d", self.resumed_from, trainer.global_step, trainer.current_epoch
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Training's random stream starts here: restored on resume, else seeded per rank.
        if self._saved_rng is not None:
            rng.restore(self._saved_rng)
            self._saved_rng = None
        else:
            if self.resumed_from is not None and trainer.is_global_zero:
                log.warning(
                    "%s was saved by a different number of processes: the weights and optimizer state are "
                    "resharded exactly, but random state is seeded afresh and the data order differs",
                    self.resumed_from,
                )
            seed = os.environ.get("PL_GLOBAL_SEED")
            if seed is not None:
                rng.seed_process(int(seed), random_stream_rank(trainer))
        self._step_seen = trainer.global_step

    # The first hooks after Lightning has logged the metrics of the step a pending save is of (see ``save``).
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._open_commit_gate()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._open_commit_gate()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._open_commit_gate()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        stepped, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        # Only right after an optimizer step: no gradients are mid-accumulation.
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if self._writer is not None:
            self._writer.wait_staged()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_last:
            self.save(trainer, pl_module)
        self._wait_until_committed()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._open_commit_gate()
        if self._writer is not None:
            try:
                self._writer.wait()  # let a save in flight commit
            except Exception as err:  # the original exception matters more
                log.error("checkpoint save in flight failed: %s", err)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._open_commit_gate()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def rollback(self, trainer: Trainer, pl_module: LightningModule) -> Optional[int]:
        """Put the model, optimizer, LR schedulers and loss scaler back to the newest valid checkpoint, mid-training
        (e.g. after a loss spike); the loops and the data go on, so the batches since then are skipped.
        Call on every rank. Returns the checkpoint's step, or None when there is no checkpoint yet."""
        self._open_commit_gate()
        self._writer.wait()
        path = choose_checkpoint(Path(self.dirpath), self._group)
        if path is None:
            return None
        trainer_state, _ = load(trainer, pl_module, path, self._group)
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, trainer_state["lr_schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        trainer.precision_plugin.load_state_dict(trainer_state["precision"])
        if trainer.is_global_zero:
            log.warning("rolled model, optimizer and LR schedule back to %s at step %d", path, trainer.global_step)
        return trainer_state["global_step"]

    def save(self, trainer: Trainer, pl_module: LightningModule, wait: bool = False) -> None:
        """Save the current step (once), then return when staged, or, with ``wait``, when committed.
        Without ``wait`` the save commits at the next hook of this callback: the step's metrics are
        logged after ``on_train_batch_end``, and the loggers keep everything logged before a
        checkpoint they were told of (``after_save_checkpoint``), so no step before the checkpoint a
        killed run resumes from is missing from them."""
        self._open_commit_gate()  # the previous save's
        if trainer.global_step != self._last_saved_step:
            state, tensors = collect(trainer, pl_module)
            summary = {
                "epoch": trainer.current_epoch,
                "world_size": trainer.world_size,
                "mlflow_run_id": state[TRAINER]["mlflow_run_id"],
                "run": self._identity,  # which runs may resume it
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__,
            }
            self._commit_gate = threading.Event() if self.async_save else None
            self._writer.save(trainer.global_step, state, tensors, summary, self._commit_gate)
            self._last_saved_step = trainer.global_step
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)
        if wait:
            self._wait_until_committed()

    def _open_commit_gate(self) -> None:
        if self._commit_gate is not None:
            self._commit_gate.set()
            self._commit_gate = None

    def _wait_until_committed(self) -> None:
        self._open_commit_gate()
        self._writer.wait()
        if self._group is not None:
            # Rank 0 commits after the others have written; hold every rank until then, so that a
            # launcher which stops the job when one rank exits cannot cut the commit short.
            dist.barrier(group=self._group)
