"""Training progress: a live bar when stderr is a terminal, else one log line every N training steps;
and one line per validation either way.

A progress bar redraws in place, which turns into noise in Slurm or Kubernetes logs; there a line per
interval shows the same things (step, loss, learning rate, throughput, time left) and stays greppable.
In a terminal the bar (``uma_lightning.progress``) shows step/max_steps, loss, samples/s and time left,
and the other lines (validation, the summary) print above it.
"""

from __future__ import annotations

import logging
import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from uma_lightning.progress import Progress, format_duration

log = logging.getLogger("uma_lightning")


class ProgressLog(Callback):
    def __init__(self, every_n_steps: int = 10):
        """
        Args:
            every_n_steps: When stderr is not a terminal (a job log), log a line after every this many
                optimizer steps (and after the last one); a terminal gets a live bar instead.
        """
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._start: float | None = None
        self._start_step = 0
        self._bar: Progress | None = None

    @rank_zero_only
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start, self._start_step = time.monotonic(), trainer.global_step
        total = trainer.max_steps if trainer.max_steps > 0 else "?"
        log.info("training: %s steps, %s process(es)", total, trainer.world_size)
        total_steps = trainer.max_steps if trainer.max_steps > 0 else None
        bar = Progress(total_steps, "train", "step", initial=self._start_step, lines=False)
        self._bar = bar if bar.live else None  # off a terminal, the lines below stand in for it

    @rank_zero_only
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self._bar is not None:
            self._bar.update(step, _bar_figures(trainer.callback_metrics))
            return
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if step == self._start_step or (step % self.every_n_steps and not last) or self._start is None:
            return
        elapsed = time.monotonic() - self._start
        formats = {
            "train/loss": "loss {:.4f}",
            "lr": "lr {:.2e}",
            "grad_norm": "grad_norm {:.3f}",
            "throughput/samples_per_sec": "{:.1f} samples/s",
            "throughput/mfu_percent": "mfu {:.1f}%",
        }
        values = _read(trainer.callback_metrics, formats)
        parts = [f"step {step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        parts += [formats[name].format(value) for name, value in values.items()]
        if trainer.max_steps > 0:
            remaining = elapsed / (step - self._start_step) * (trainer.max_steps - step)
            parts.append(f"eta {format_duration(remaining)}")
        log.info(" | ".join(parts))

    @rank_zero_only
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_bar()
        if self._start is not None:
            steps = trainer.global_step - self._start_step
            log.info("trained %d steps in %s", steps, format_duration(time.monotonic() - self._start))

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning skips the training loop (and its start and end hooks) when a resumed run is
        # already at max_steps, e.g. after a crash between the last checkpoint and the exit.
        if self._start is None and 0 < trainer.max_steps <= trainer.global_step:
            log.info(
                "trained 0 steps: the run is already at step %d (trainer.max_steps %d); raise max_steps to train on",
                trainer.global_step,
                trainer.max_steps,
            )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close_bar()  # the error and its traceback print below the bar, with logging back as it was

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # Headline metrics only (val/loss, val/action_mse, ...); the per-dimension and per-step
        # breakdowns (val/action_mse/dq1, ...) would fill the line and stay in MLflow.
        values = [
            f"{name} {float(value):.4f}"
            for name, value in sorted(trainer.callback_metrics.items())
            if name.startswith("val/") and name.count("/") == 1
        ]
        if values:
            log.info("validation at step %d: %s", trainer.global_step, " | ".join(values))


def _bar_figures(metrics) -> str:
    formats = {"train/loss": "loss {:.4f}", "throughput/samples_per_sec": "{:.1f} samples/s"}
    return ", ".join(formats[name].format(value) for name, value in _read(metrics, formats).items())


def _read(metrics: dict, names) -> dict[str, float]:
    """Those of ``names`` that ``metrics`` holds, as floats read from the device together: one host
    sync rather than one per metric."""
    present = [name for name in names if name in metrics]
    if not present:
        return {}
    tensors = [torch.as_tensor(metrics[name]).detach().float().reshape(()) for name in present]
    stacked = torch.stack([tensor.to(tensors[0].device) for tensor in tensors])
    return dict(zip(present, stacked.tolist()))
