"""LightningDataModule over a LeRobot v2.1 dataset, by default the embedded planar-arm dataset."""

# No `from __future__ import annotations`: LightningCLI (jsonargparse) reads the real annotations of
# `RobotDataModule.__init__` to build the command line.
import logging
import math
from pathlib import Path
from typing import Literal, Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader

from uma_lightning.data.dataset import FrameDataset, NormMode, Normalizer
from uma_lightning.data.generate import ensure_dataset
from uma_lightning.data.lerobot import ACTION_KEY, STATE_KEY, LeRobotMetadata
from uma_lightning.data.spec import DataSpec

logger = logging.getLogger(__name__)


def split_episodes(n_episodes: int, val_episodes: Union[int, float]) -> tuple[list[int], list[int]]:
    """Train and validation episode indices, holding out the last episodes for validation.

    An int is a count of episodes, a float a fraction in [0, 1) (at least one episode when > 0).
    """
    if isinstance(val_episodes, float):
        if not 0.0 <= val_episodes < 1.0:
            raise ValueError(f"val_episodes as a fraction must be in [0, 1), got {val_episodes}")
        n_val = max(1, math.ceil(val_episodes * n_episodes)) if val_episodes > 0 else 0
    else:
        n_val = int(val_episodes)
    if not 0 <= n_val < n_episodes:
        raise ValueError(f"val_episodes={val_episodes} must leave at least one of {n_episodes} episodes for training")
    return list(range(n_episodes - n_val)), list(range(n_episodes - n_val, n_episodes))


class RobotDataModule(L.LightningDataModule):
    """Per-frame samples of a robot dataset, batched as described in `uma_lightning.data.spec`.

    `spec` is ready right after construction (the CLI links it into the model's constructor), so the
    constructor reads meta/info.json, generating the embedded dataset first when `root` is None.
    """

    def __init__(
        self,
        root: Optional[str] = None,
        n_episodes: int = 200,
        image_size: int = 64,
        dataset_seed: int = 0,
        cache_dir: Optional[str] = None,
        n_obs_steps: int = 1,
        action_horizon: int = 8,
        batch_size: int = 32,
        num_workers: int = 1,
        val_episodes: Union[int, float] = 0.1,
        state_norm: NormMode = "mean_std",
        action_norm: NormMode = "min_max",
        decode_cache_mb: float = 256.0,
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        pin_memory: Optional[bool] = None,
        seed: int = 0,
        predict_split: Literal["train", "val"] = "val",
    ) -> None:
        """
        Args:
            root: LeRobot v2.1 dataset directory; None uses the embedded planar-arm dataset (generated once, cached).
            n_episodes: Episodes of the embedded dataset (ignored with `root`).
            image_size: Square image side in pixels of the embedded dataset (ignored with `root`).
            dataset_seed: Generation seed of the embedded dataset (ignored with `root`).
            cache_dir: Cache directory of the embedded dataset; None uses $UMA_CACHE_DIR or ~/.cache/uma_lightning.
            n_obs_steps: Observation history length per sample, ending at the sample's frame.
            action_horizon: Length of the action chunk per sample, starting at the sample's frame.
            batch_size: Samples per batch (per device).
            num_workers: DataLoader worker processes.
            val_episodes: Episodes held out for validation, taken from the end: a count (int) or a fraction (float).
            state_norm: Normalisation of the state: mean_std, min_max or quantile (q01 -> -1, q99 -> +1).
            action_norm: Normalisation of the actions: mean_std, min_max or quantile.
            decode_cache_mb: Bound on decoded video kept per process, in MiB.
            persistent_workers: Keep worker processes (and their decode caches) alive between epochs.
            prefetch_factor: Batches each worker loads ahead.
            pin_memory: Pin batches in page-locked memory; None pins only when CUDA is available.
            seed: Seed of the training-set shuffle.
            predict_split: Episodes `uma predict` runs on: the held-out (val) or the training episodes.
        """
        super().__init__()
        for name, value in (("batch_size", batch_size), ("prefetch_factor", prefetch_factor)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        if root is None:
            self.root = ensure_dataset("planar_arm", n_episodes, image_size, dataset_seed, cache_dir)
        else:
            self.root = Path(root)
        self.metadata = LeRobotMetadata.load(self.root)
        self.train_episodes, self.val_episodes = split_episodes(len(self.metadata.episodes), val_episodes)
        logger.info(
            "dataset %s: %d train and %d validation episodes", self.root, len(self.train_episodes), len(self.val_episodes)
        )
        self.spec = DataSpec(
            cameras=self.metadata.cameras,
            image_size=self.metadata.image_size,
            state_dim=self.metadata.state_dim,
            action_dim=self.metadata.action_dim,
            n_obs_steps=n_obs_steps,
            action_horizon=action_horizon,
            fps=self.metadata.fps,
        )
        # Built here, not in setup(), so a bad mode fails at construction and inference can undo
        # the normalisation without loading the dataset.
        self.state_normalizer = Normalizer.from_stats(state_norm, self.metadata.stats[STATE_KEY], STATE_KEY)
        self.action_normalizer = Normalizer.from_stats(action_norm, self.metadata.stats[ACTION_KEY], ACTION_KEY)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.train_dataset: Optional[FrameDataset] = None
        self.val_dataset: Optional[FrameDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = self._dataset(self.train_episodes)
        if self.val_dataset is None and self.val_episodes:
            self.val_dataset = self._dataset(self.val_episodes)

    def train_dataloader(self) -> DataLoader:
        # A seeded generator makes the shuffle order reproducible; dropping the last partial batch
        # keeps batch shapes static (compiled models, per-batch metrics).
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return self._loader(self.train_dataset, shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> Union[DataLoader, list]:
        if self.val_dataset is None:
            return []  # no validation episodes: Lightning skips validation
        return self._loader(self.val_dataset, shuffle=False, drop_last=False, generator=None)

    def test_dataloader(self) -> Union[DataLoader, list]:
        """The held-out episodes, as in validation: the embedded data has no third split."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Every frame of the `predict_split` episodes, in order."""
        episodes = self.val_episodes if self.hparams.predict_split == "val" else self.train_episodes
        if not episodes:
            raise ValueError(f"predict_split={self.hparams.predict_split!r} has no episodes (val_episodes={self.hparams.val_episodes})")
        dataset = self.val_dataset if self.hparams.predict_split == "val" else self._dataset(episodes)
        return self._loader(dataset, shuffle=False, drop_last=False, generator=None)

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        """Raw robot state -> the normalised state a model trained on this data expects."""
        return self.state_normalizer.normalize(state)

    def denormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Normalised model actions -> raw robot actions."""
        return self.action_normalizer.denormalize(actions)

    def normalization(self) -> dict:
        """The state and action normalisation as plain values, with the dimension names; models keep it
        in their checkpoints so that inference undoes it without the dataset."""
        features = self.metadata.features
        return {
            "state": {**self.state_normalizer.to_dict(), "names": list(features[STATE_KEY]["names"])},
            "action": {**self.action_normalizer.to_dict(), "names": list(features[ACTION_KEY]["names"])},
        }

    def _dataset(self, episodes: list[int]) -> FrameDataset:
        hp = self.hparams
        return FrameDataset(
            self.metadata,
            episodes,
            n_obs_steps=hp.n_obs_steps,
            action_horizon=hp.action_horizon,
            state_norm=hp.state_norm,
            action_norm=hp.action_norm,
            decode_cache_mb=hp.decode_cache_mb,
        )

    def _loader(
        self, dataset: Optional[FrameDataset], shuffle: bool, drop_last: bool, generator: Optional[torch.Generator]
    ) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before requesting dataloaders")
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            generator=generator,
            num_workers=workers,
            persistent_workers=self.hparams.persistent_workers and workers > 0,
            prefetch_factor=self.hparams.prefetch_factor if workers > 0 else None,
            pin_memory=self.pin_memory,
        )
