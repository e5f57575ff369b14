"""Training throughput and model FLOPs utilisation (MFU), measured between consecutive training-batch ends.

The interval includes data wait, so these are the rates a user gets, not the kernels' peak; time
spent in validation is left out. The first batch after the start of an epoch is skipped: it pays
one-off costs (worker start-up, allocator warm-up, lazy init).

MFU is the model's training FLOPs per sample (``pl_module.flops_per_sample``, attention included)
times samples per second per device, over the device's peak dense TFLOP/s for the run's precision
(see ``peak_flops``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.callbacks.peak_flops import resolve_peak
from uma_lightning.ranks import data_parallel_rank
from uma_lightning.tracking import find_mlflow_logger

log = logging.getLogger("uma_lightning")


class ThroughputLogger(Callback):
    def __init__(self, peak_tflops: Optional[float] = None) -> None:
        """
        Args:
            peak_tflops: Peak dense TFLOP/s of one device, the MFU denominator. Empty: the datasheet
                figure for the GPU and precision, or a short matmul probe on a CPU or an unknown GPU.
        """
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")
        self.peak_tflops = peak_tflops
        self._peak: Optional[float] = None
        self._last: Optional[float] = None
        self._validation_start: Optional[float] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not getattr(pl_module, "flops_per_sample", None):
            return
        self._peak, source = resolve_peak(pl_module.device, trainer.precision, self.peak_tflops)
        if trainer.is_global_zero:
            log.info("MFU peak: %.3g TFLOP/s per device (%s)", self._peak, source)
        logger = find_mlflow_logger(trainer)
        if logger is not None:
            # Tags, not params: a probe measures a slightly different peak when a run is resumed.
            logger.experiment.set_tag(logger.run_id, "throughput.peak_tflops_per_device", f"{self._peak:.6g}")
            logger.experiment.set_tag(logger.run_id, "throughput.peak_source", source)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:
            return
        batch_size = len(batch["sample_id"])
        samples_per_sec = batch_size * data_parallel_rank(trainer)[1] / (now - last)
        rates = {"throughput/samples_per_sec": samples_per_sec}
        tokens_per_sample = getattr(pl_module, "tokens_per_sample", None)
        if tokens_per_sample:
            rates["throughput/tokens_per_sec"] = samples_per_sec * tokens_per_sample
        if self._peak:
            # Every device shares the work, tensor-parallel ones included.
            tflops = samples_per_sec / trainer.world_size * pl_module.flops_per_sample / 1e12
            if tflops > self._peak:
                # The peak cannot be below what the run achieves: a probe taken while other work held
                # the CPU, or a wrong peak_tflops. The achieved rate is the better bound from now on.
                log.warning(
                    "MFU: %.3g TFLOP/s per device achieved, above the peak of %.3g (%s); using the achieved rate as the peak",
                    tflops,
                    self._peak,
                    "the configured peak_tflops"
                    if self.peak_tflops
                    else "a matmul probe taken while the machine was busy",
                )
                self._peak = tflops
            rates["throughput/tflops_per_device"] = tflops
            rates["throughput/mfu_percent"] = 100 * tflops / self._peak
        pl_module.log_dict(rates, batch_size=batch_size)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch restarts the loader (worker start-up); that gap is not steady-state throughput.
        self._last = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last is not None and self._validation_start is not None:
            self._last += time.perf_counter() - self._validation_start
        self._validation_start = None
