"""What every RL learner shares: the policy, publishing it to the actors, and logging what they report.

A learner is a LightningModule trained by the Lightning Trainer, so strategies (DDP across ranks),
checkpointing, callbacks and MLflow work as in the other stages. Each Lightning epoch is one RL
iteration: ``RolloutDataModule`` hands over a batch of trajectories, ``update`` (the algorithm) takes
as many optimizer steps as it needs, and the new weights are published as the next policy version.
``trainer.global_step`` counts optimizer steps; ``policy_version`` counts iterations.

Subclasses implement two extension points: ``build_policy()`` (any module following the interface
in ``uma_lightning.rl.policy``) and ``update(trajectories)``. A subclass declares its settings once,
in its signature, passes ``env``, ``gamma`` and ``seed`` on as ``**kwargs``, and reads its settings
from ``self.hparams``: this class saves every constructor argument (``uma_lightning.hyperparameters``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from typing import Any, Optional

import lightning as L
import torch

from uma_lightning.hyperparameters import constructor_arguments
from uma_lightning.rl.env import EnvSpec
from uma_lightning.rl.policy import RunningNorm, check_policy

log = logging.getLogger("uma_lightning")


class RLLearner(L.LightningModule):
    needs_value = False  # whether the policy must return a value estimate
    key_metric = "rollout/return_window"  # logged as final/rollout_return_window when training ends

    def __init__(self, env: Optional[EnvSpec] = None, gamma: float = 0.99, seed: int = 0):
        """
        Args:
            env: Shapes of the environment; ``uma rl`` links them from the data module.
            gamma: Discount factor.
            seed: Seed of the learner's own sampling.
        """
        super().__init__()
        if env is None:
            raise ValueError(
                f"{type(self).__name__} needs the env spec: pass env=datamodule.env_spec (uma rl links it for you)"
            )
        self.env_spec = EnvSpec(**env) if isinstance(env, dict) else env
        self.gamma, self.seed = gamma, seed
        self.automatic_optimization = False  # an update takes many optimizer steps on one batch
        self.policy_version = 0
        self.policy: Optional[torch.nn.Module] = None  # subclasses build it from ``self.hparams``
        # Every constructor argument, a subclass's own too: subclasses read their settings from
        # ``self.hparams`` and name each only in their signature.
        arguments = constructor_arguments(inspect.currentframe(), RLLearner)
        self.save_hyperparameters({**arguments, "env": dataclasses.asdict(self.env_spec)}, logger=False)

    # ---- extension points ---------------------------------------------------------------------------

    def build_policy(self) -> torch.nn.Module:
        raise NotImplementedError

    def update(self, trajectories: dict[str, torch.Tensor]) -> dict[str, float]:
        """Learn from one batch of trajectories (fields as in ``uma_lightning.rl.rollout``, ``[T, B, ...]``);
        returns metrics to log, with the number of samples its optimizer steps saw as ``learner/samples``."""
        raise NotImplementedError

    # ---- Lightning hooks ----------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        # Before Lightning fetches the first batch, and after a checkpoint's weights were restored.
        check_policy(self.policy, self.env_spec, self.needs_value)
        experience = self.experience
        if self.device.type == "cpu":
            # The actors run on the same cores; intra-op threads beyond what they leave free only
            # wait for each other (small networks gain nothing from them anyway).
            threads = max(1, (os.cpu_count() or 1) - experience.local_workers)
            if threads < torch.get_num_threads():
                torch.set_num_threads(threads)
                log.info(
                    "learner on CPU: %d intra-op thread(s), the cores its %d local actor processes leave",
                    threads,
                    experience.local_workers,
                )
        experience.start(self.policy, return_discount=self.gamma)
        experience.publish(self.policy, self.policy_version)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        metrics = self.update(batch["trajectories"])
        elapsed = time.perf_counter() - start
        metrics["time/update_sec"] = elapsed
        metrics["throughput/learner_samples_per_sec"] = metrics.pop("learner/samples", 0.0) / max(elapsed, 1e-9)
        self.policy_version += 1
        self.experience.publish(self.policy, self.policy_version)
        metrics["policy_version"] = float(self.policy_version)
        self.log_dict({**batch["stats"], **metrics}, batch_size=1)
        if self.experience.done:
            self.trainer.should_stop = True

    def on_train_epoch_end(self) -> None:
        if self.experience.done:  # also true when a run resumes after its budget was spent
            self.trainer.should_stop = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["policy_version"] = self.policy_version

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_version = checkpoint.get("policy_version", 0)

    # ---- helpers for subclasses -----------------------------------------------------------------------

    @property
    def experience(self):
        from uma_lightning.rl.data import RolloutDataModule

        data = self.trainer.datamodule
        if not isinstance(data, RolloutDataModule):
            raise TypeError(f"{type(self).__name__} trains on a RolloutDataModule, got {type(data).__name__}")
        return data

    def update_observation_stats(self, obs: torch.Tensor) -> None:
        """Fold ``obs`` into the policy's observation statistics, if it keeps them (``policy.obs_norm``)."""
        norm = getattr(self.policy, "obs_norm", None)
        if isinstance(norm, RunningNorm):
            self.update_running_norm(norm, obs, event_dims=1)

    def update_running_norm(self, norm: RunningNorm, values: torch.Tensor, event_dims: int) -> None:
        """Merge ``values`` into ``norm`` with every rank's batch, so all ranks keep the same statistics."""
        moments = RunningNorm.moments(values, event_dims)
        gathered = self.all_gather(moments) if self._trainer is not None else moments
        norm.update(gathered)
