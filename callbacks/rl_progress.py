"""One log line every N RL iterations: environment steps, episode return, throughput, policy lag,
actor restarts and time left, readable in a terminal and in a job log (as ProgressLog is for
supervised training)."""

from __future__ import annotations

import logging
import time

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from uma_lightning.progress import format_duration

log = logging.getLogger("uma_lightning")

_FIELDS = (
    ("rollout/return_window", "return {:.1f}"),
    ("rollout/episode_length", "length {:.0f}"),
    ("throughput/env_steps_per_sec", "{:.0f} env steps/s"),
    ("throughput/learner_samples_per_sec", "{:.0f} learner samples/s"),
    ("time/wait_fraction", "waiting {:.0%}"),
    ("policy_lag/mean", "lag {:.2f}"),
    ("actors/restarts", "restarts {:.0f}"),
)


class RolloutProgressLog(Callback):
    def __init__(self, every_n_iterations: int = 10):
        """
        Args:
            every_n_iterations: Log a line after every this many RL iterations (collect + update), and after the last.
        """
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        self.every_n_iterations = every_n_iterations
        self._start: float | None = None
        self._start_steps = 0.0

    @rank_zero_only
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.monotonic()
        self._start_steps = float(getattr(trainer.datamodule, "env_steps", 0) * trainer.world_size)
        log.info(
            "training: %s env steps, %d learner process(es)%s",
            _total(trainer),
            trainer.world_size,
            f", resuming at {self._start_steps:.0f}" if self._start_steps else "",
        )

    @rank_zero_only
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = trainer.callback_metrics
        iteration = getattr(pl_module, "policy_version", trainer.current_epoch + 1)
        total = _total(trainer)
        steps = float(metrics.get("rollout/env_steps", 0.0))
        last = trainer.should_stop or (total is not None and steps >= total)
        if (
            self._start is None
            or "rollout/env_steps" not in metrics
            or (iteration % self.every_n_iterations and not last)
        ):
            return
        parts = [f"iteration {iteration}", f"env steps {steps:.0f}" + (f"/{total}" if total else "")]
        parts += [fmt.format(float(metrics[name])) for name, fmt in _FIELDS if name in metrics]
        done = steps - self._start_steps
        if total and done > 0:
            parts.append(f"eta {format_duration((time.monotonic() - self._start) / done * max(total - steps, 0))}")
        log.info(" | ".join(parts))

    @rank_zero_only
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._start is not None:
            steps = float(trainer.callback_metrics.get("rollout/env_steps", self._start_steps)) - self._start_steps
            log.info("collected %d env steps in %s", steps, format_duration(time.monotonic() - self._start))


def _total(trainer: Trainer):
    hparams = getattr(trainer.datamodule, "hparams", {})
    return hparams.get("total_env_steps")
