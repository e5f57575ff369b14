"""Memory per training step: the process's resident set (CPU RSS) and, on a GPU, CUDA allocated,
reserved and peak memory; plus a leak detector.

The leak detector fits a least-squares line to the last ``leak_window`` samples, after
``leak_warmup_steps`` (caches and allocator pools fill up early on, which is not a leak). When the
slope is at least ``leak_min_growth_mib`` per step and the line explains the samples (R² at least
``leak_min_r2``, i.e. memory keeps rising rather than jumping once), it warns with the growth rate,
then starts a new window. Values are of global rank zero.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.tracking import log_step_metrics

log = logging.getLogger("uma_lightning")

MIB = 2**20


@dataclass
class LeakDetector:
    """Steady growth of one memory series, in MiB per step, from (step, MiB) samples."""

    warmup_steps: int
    window: int
    min_growth_mib: float
    min_r2: float
    samples: deque = field(default_factory=deque)

    def add(self, step: int, mib: float) -> Optional[float]:
        """Records a sample; returns the growth per step when the window shows a leak."""
        if step < self.warmup_steps:
            return None
        self.samples.append((step, mib))
        if len(self.samples) > self.window:
            self.samples.popleft()
        if len(self.samples) < self.window:
            return None
        slope, r2 = _fit_line(self.samples)
        if slope >= self.min_growth_mib and r2 >= self.min_r2:
            self.samples.clear()
            return slope
        return None


def _fit_line(points) -> tuple[float, float]:
    """Slope and coefficient of determination of the least-squares line through ``points``."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    syy = sum((y - mean_y) ** 2 for _, y in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    if sxx == 0 or syy == 0:
        return 0.0, 0.0
    return sxy / sxx, sxy * sxy / (sxx * syy)


class MemoryMonitor(Callback):
    def __init__(
        self,
        every_n_steps: int = 1,
        leak_warmup_steps: int = 50,
        leak_window: int = 100,
        leak_min_growth_mib: float = 1.0,
        leak_min_r2: float = 0.9,
    ):
        """
        Args:
            every_n_steps: Sample memory after every this many training batches.
            leak_warmup_steps: Steps before leak detection starts.
            leak_window: Samples the leak detector fits a line to.
            leak_min_growth_mib: Growth in MiB per step from which a steady rise counts as a leak.
            leak_min_r2: How straight the rise must be (R² of the fitted line, 0 to 1).
        """
        if every_n_steps < 1 or leak_window < 3:
            raise ValueError(f"need every_n_steps >= 1 and leak_window >= 3, got {every_n_steps} and {leak_window}")
        if not 0 <= leak_min_r2 <= 1:
            raise ValueError(f"leak_min_r2 must be in [0, 1], got {leak_min_r2}")
        self.every_n_steps = every_n_steps
        self._detectors = {
            name: LeakDetector(leak_warmup_steps, leak_window, leak_min_growth_mib, leak_min_r2)
            for name in ("cpu_rss", "cuda_allocated")
        }
        self._process = psutil.Process()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero:
            return
        metrics = {"memory/cpu_rss_mib": self._process.memory_info().rss / MIB}
        device = pl_module.device
        if device.type == "cuda":
            metrics["memory/cuda_allocated_mib"] = torch.cuda.memory_allocated(device) / MIB
            metrics["memory/cuda_reserved_mib"] = torch.cuda.memory_reserved(device) / MIB
            metrics["memory/cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
            torch.cuda.reset_peak_memory_stats(device)
        for name, detector in self._detectors.items():
            value = metrics.get(f"memory/{name}_mib")
            growth = None if value is None else detector.add(step, value)
            if growth is not None:
                log.warning(
                    "memory leak suspected: %s grew %.2f MiB per step over the last %d samples (now %.0f MiB, step %d)",
                    name,
                    growth,
                    detector.window,
                    value,
                    step,
                )
                metrics[f"memory/{name}_leak_mib_per_step"] = growth
        log_step_metrics(trainer, metrics)
