"""Closed-loop success rate: at the end of validation and test, the module's ``Policy`` drives
planar-arm episodes on scenes the dataset never shows (``uma_lightning.sim.closed_loop``).

Logs ``<split>/success_rate`` and ``<split>/goal_distance`` (metres from the named target at the end).
Data-parallel processes split the episodes (tensor-parallel ones, which act as one policy, run the
same ones) and each runs the same number of policy calls, so sharded models stay in step; the metrics
are averaged over all episodes of all processes.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import MeanMetric

from uma_lightning.cli_errors import ConfigError
from uma_lightning.modules.metrics import log_reduced
from uma_lightning.ranks import data_parallel_rank
from uma_lightning.sim.closed_loop import run_episodes

log = logging.getLogger("uma_lightning")


class ClosedLoopEval(Callback):
    def __init__(self, n_episodes: int = 50, execute_steps: Optional[int] = None, seed: int = 0):
        """
        Args:
            n_episodes: Episodes per evaluation, split across processes.
            execute_steps: Actions of each predicted chunk executed before the policy is asked
                again; None: half the chunk.
            seed: Selects the evaluation scenes (the same ones every evaluation).
        """
        if n_episodes < 1:
            raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
        self.n_episodes, self.execute_steps, self.seed = n_episodes, execute_steps, seed

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before any step: found at the first validation, the mismatch would cost the steps before it.
        cameras = pl_module.spec.cameras
        if len(cameras) != 1:
            raise ConfigError(
                f"trainer.callbacks: ClosedLoopEval runs the one-camera planar arm simulator, and the data has "
                f"{len(cameras)} cameras ({', '.join(cameras)}); drop the callback for this data"
            )

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._evaluate(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate(trainer, pl_module, "test")

    def _evaluate(self, trainer: Trainer, pl_module: LightningModule, split: str) -> None:
        policy = pl_module.policy()
        spec = policy.spec
        execute = self.execute_steps or max(spec.action_horizon // 2, 1)
        # Every process gets the same number of episodes (the last ones may repeat), so all make the same
        # calls. Tensor-parallel ranks act as one policy: they split no episodes, and run the same ones.
        rank, ranks = data_parallel_rank(trainer)
        per_rank = math.ceil(self.n_episodes / ranks)
        mine = [(rank * per_rank + i) % self.n_episodes for i in range(per_rank)]
        started = time.monotonic()
        with torch.no_grad():
            results = run_episodes(
                lambda obs: policy(obs).cpu().numpy(),
                mine,
                spec.n_obs_steps,
                execute,
                seed=self.seed,
                stop_when_done=trainer.world_size == 1,
            )
        owned = [r for index, r in zip(mine, results) if index >= rank * per_rank]  # not the repeats
        success, distance = MeanMetric().to(pl_module.device), MeanMetric().to(pl_module.device)
        for result in owned:
            success.update(float(result.success))
            distance.update(result.goal_distance)
        rate, mean_distance = success.compute(), distance.compute()  # averaged over all processes
        log_reduced(pl_module, {f"{split}/success_rate": rate, f"{split}/goal_distance": mean_distance})
        if trainer.is_global_zero:
            log.info(
                "closed loop (%s): success %.1f%% of %d episodes, mean final distance to the target %.3f, %.0fs",
                split,
                100 * float(rate),
                self.n_episodes,
                float(mean_distance),
                time.monotonic() - started,
            )
