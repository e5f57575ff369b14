"""Training throughput and model FLOPs utilisation (MFU), measured between consecutive training-batch ends.

The interval includes data wait, so these are the rates a user gets, not the kernels' peak; time
spent in validation is left out. The first batch after the start of an epoch is skipped: it pays
one-off costs (worker start-up, allocator warm-up, lazy init).

MFU is the model's training FLOPs per sample, counted by torch's flop counter over the first batch's
step (``pl_module.count_flops_per_sample``, attention included), times samples per second per device,
over the device's peak dense TFLOP/s for the run's precision (see ``peak_flops``). Tokens per second
need the network's ``tokens_per_sample`` (optional in the model contract).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.callbacks.peak_flops import keep_achieved_rate, resolve_peak
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
        self._peak_source = ""
        self._flops_per_sample: Optional[int] = None
        self._peak_raised = False
        self._last: Optional[float] = None
        self._validation_start: Optional[float] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not callable(getattr(pl_module, "count_flops_per_sample", None)):
            return
        self._peak, source = resolve_peak(pl_module.device, trainer.precision, self.peak_tflops)
        self._peak_source = source
        if trainer.is_global_zero:
            log.info("MFU peak: %.3g TFLOP/s per device (%s)", self._peak, source)
        logger = find_mlflow_logger(trainer)
        if logger is not None:
            # Tags, not params: a probe measures a slightly different peak when a run is resumed.
            logger.experiment.set_tag(logger.run_id, "throughput.peak_tflops_per_device", f"{self._peak:.6g}")
            logger.experiment.set_tag(logger.run_id, "throughput.peak_source", source)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self._peak and self._flops_per_sample is None:
            self._flops_per_sample = pl_module.count_flops_per_sample(batch)  # counted once, then cached

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
        if self._peak and self._flops_per_sample:
            # Every device shares the work, tensor-parallel ones included.
            tflops = samples_per_sec / trainer.world_size * self._flops_per_sample / 1e12
            if tflops > self._peak:
                self._raise_peak(trainer, tflops)
            rates["throughput/tflops_per_device"] = tflops
            rates["throughput/mfu_percent"] = 100 * tflops / self._peak
        pl_module.log_dict(rates, batch_size=batch_size)

    def _raise_peak(self, trainer: Trainer, tflops: float) -> None:
        """The peak cannot be below what the run achieves: a probe taken while other work held the
        machine, or a wrong peak_tflops. The best rate achieved is the peak from now on (a probed one
        is kept for later runs on this host when training ends); said once per run."""
        if not self._peak_raised and trainer.is_global_zero:
            log.warning(
                "MFU: %.3g TFLOP/s per device achieved, above the peak of %.3g (%s); the best rate achieved is the "
                "peak from now on%s",
                tflops,
                self._peak,
                "the configured peak_tflops" if self.peak_tflops else self._peak_source.split(";")[0],
                ", kept for later runs on this host" if self._probed else "",
            )
        self._peak, self._peak_raised = tflops, True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Written once, not at each raise: file locking between steps would count in the step times.
        if self._peak_raised and self._probed:
            keep_achieved_rate(pl_module.device, trainer.precision, self._peak)

    @property
    def _probed(self) -> bool:
        return self._peak_source.startswith("matmul probe")

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch restarts the loader (worker start-up); that gap is not steady-state throughput.
        self._last = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last is not None and self._validation_start is not None:
            self._last += time.perf_counter() - self._validation_start
        self._validation_start = None
