"""How long each training step waits for its batch, and that wait's share of the step.

The wait is the time from the end of one training batch to the start of the next: fetching the
batch from the loader and moving it to the device. Steps that also ran validation or wrote a
checkpoint in that gap are not counted, since that time is not the loader's. Logged per step as
`data/wait_s` and `data/wait_fraction`, and as the running `data/wait_fraction_mean` (total wait over
total step time since training started). When the loader counts samples it skipped as bad
(`on_bad_data: skip`), their running total is logged as `data/bad_samples`.
"""

from __future__ import annotations

import time

from lightning.pytorch import Callback, LightningModule, Trainer


class DataWaitLogger(Callback):
    def __init__(self) -> None:
        self._batch_end: float | None = None
        self._step_start: float | None = None
        self._wait = 0.0
        self._interrupted = False
        self.total_wait = 0.0
        self.total_step = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._batch_end is not None and not self._interrupted:
            self._wait = now - self._batch_end
        else:
            self._wait = None
        self._interrupted = False
        self._step_start = now - (self._wait or 0.0)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self._batch_end = now
        if self._wait is None or self._step_start is None:
            return
        step = now - self._step_start
        self.total_wait += self._wait
        self.total_step += step
        size = len(batch["sample_id"]) if isinstance(batch, dict) and "sample_id" in batch else None
        metrics = {
            "data/wait_s": self._wait,
            "data/wait_fraction": self._wait / step,
            "data/wait_fraction_mean": self.total_wait / self.total_step,
        }
        bad = getattr(trainer.train_dataloader, "bad_samples", None)
        if bad is not None:
            metrics["data/bad_samples"] = float(bad)
        pl_module.log_dict(metrics, batch_size=size)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._interrupted = True

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint) -> None:
        self._interrupted = True

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch restarts the loader (worker start-up): not steady-state waiting.
        self._batch_end = None
