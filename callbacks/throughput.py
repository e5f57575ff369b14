"""Training throughput: samples/s and tokens/s, measured between consecutive training-batch ends.

The interval includes data wait, so this is the rate a user gets, not the kernels' peak. The first
batch is skipped: it pays one-off costs (allocator warm-up, lazy init).
"""

from __future__ import annotations

import time

from lightning.pytorch import Callback, LightningModule, Trainer


class ThroughputLogger(Callback):
    def __init__(self) -> None:
        self._last: float | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:
            return
        samples = len(batch["sample_id"]) * _data_parallel_size(trainer)
        rates = {"throughput/samples_per_sec": samples / (now - last)}
        tokens_per_sample = getattr(pl_module, "tokens_per_sample", None)
        if tokens_per_sample:
            rates["throughput/tokens_per_sec"] = rates["throughput/samples_per_sec"] * tokens_per_sample
        pl_module.log_dict(rates, batch_size=len(batch["sample_id"]))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch restarts the loader (worker start-up); that gap is not steady-state throughput.
        self._last = None


def _data_parallel_size(trainer: Trainer) -> int:
    """Processes that see different samples: tensor-parallel ranks share their batch."""
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return sampler.get("num_replicas", trainer.world_size)
