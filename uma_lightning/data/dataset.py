"""Map-style dataset over a LeRobot v2.1 dataset: one sample per frame, in the batch contract of spec.py."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import torch
from torch.utils.data import Dataset

from uma_lightning.data.lerobot import ACTION_KEY, STATE_KEY, LeRobotMetadata
from uma_lightning.data.video import DecodedVideo, decode_video

NormMode = Literal["mean_std", "min_max", "quantile"]
# The two statistics each normalisation mode is built from.
MODE_STATISTICS: dict[str, tuple[str, str]] = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantile": ("q01", "q99")}
ArrayLike = TypeVar("ArrayLike", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class Normalizer:
    """The affine map x -> (x - offset) / scale fitted to one feature's statistics.

    mean_std: zero mean, unit std. min_max: min -> -1, max -> +1. quantile: q01 -> -1, q99 -> +1,
    which keeps rare outliers from squashing the bulk of the data.
    """

    mode: NormMode
    offset: np.ndarray  # float32 [D]
    scale: np.ndarray  # float32 [D]

    @classmethod
    def from_stats(cls, mode: str, stats: dict[str, np.ndarray], key: str) -> Normalizer:
        """Fit to the statistics of feature `key` (named in errors)."""
        if mode not in MODE_STATISTICS:
            raise ValueError(f"unknown normalisation mode {mode!r} for {key!r}; choose from {get_args(NormMode)}")
        missing = [name for name in MODE_STATISTICS[mode] if name not in stats]
        if missing:
            raise ValueError(f"statistics of {key!r} lack {missing}, needed by normalisation mode {mode!r}")
        first, second = (np.asarray(stats[name], dtype=np.float64) for name in MODE_STATISTICS[mode])
        if mode == "mean_std":
            offset, scale = first, second
        else:  # map the lower bound to -1 and the upper to +1
            offset, scale = (second + first) / 2, (second - first) / 2
        # A constant dimension has no spread to scale by: centre it and leave it unscaled.
        scale = np.where(scale > 1e-6, scale, 1.0)
        return cls(mode, np.asarray(offset, dtype=np.float32), np.asarray(scale, dtype=np.float32))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (mode, offset, scale), for checkpoints and configs."""
        return {"mode": self.mode, "offset": self.offset.tolist(), "scale": self.scale.tolist()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Normalizer:
        return cls(values["mode"], np.asarray(values["offset"], dtype=np.float32), np.asarray(values["scale"], dtype=np.float32))

    def normalize(self, x: ArrayLike) -> ArrayLike:
        offset, scale = self._like(x)
        return (x - offset) / scale

    def denormalize(self, x: ArrayLike) -> ArrayLike:
        offset, scale = self._like(x)
        return x * scale + offset

    def _like(self, x: ArrayLike) -> tuple[Any, Any]:
        if isinstance(x, torch.Tensor):
            return tuple(torch.as_tensor(v, dtype=x.dtype, device=x.device) for v in (self.offset, self.scale))
        return self.offset, self.scale


class DecodedVideoCache:
    """Least-recently-used decoded videos, bounded in bytes. A video larger than the bound is decoded
    but not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._videos: OrderedDict[Path, DecodedVideo] = OrderedDict()

    def get(self, path: Path) -> DecodedVideo:
        if path in self._videos:
            self._videos.move_to_end(path)
            return self._videos[path]
        video = decode_video(path)
        if video.nbytes <= self.max_bytes:
            self._videos[path] = video
            self.bytes += video.nbytes
            while self.bytes > self.max_bytes:
                self.bytes -= self._videos.popitem(last=False)[1].nbytes
        return video


class FrameDataset(Dataset):
    """One sample per frame of the selected episodes, as a dict following the batch contract in spec.py.

    Low-dimensional columns of all selected episodes are loaded and normalised at construction; video
    is decoded lazily, a whole episode at a time, into a per-process cache. Nothing unpicklable is held,
    so the dataset can be sent to DataLoader worker processes.
    """

    def __init__(
        self,
        metadata: LeRobotMetadata,
        episodes: Sequence[int] | None = None,
        n_obs_steps: int = 1,
        action_horizon: int = 8,
        state_norm: NormMode = "mean_std",
        action_norm: NormMode = "min_max",
        decode_cache_mb: float = 256,
        tolerance_s: float = 1e-4,
    ) -> None:
        if n_obs_steps < 1 or action_horizon < 1:
            raise ValueError(f"n_obs_steps and action_horizon must be >= 1, got {n_obs_steps}, {action_horizon}")
        n_total = len(metadata.episodes)
        self.episodes = tuple(range(n_total)) if episodes is None else tuple(int(e) for e in episodes)
        invalid = [e for e in self.episodes if not 0 <= e < n_total]
        if invalid or not self.episodes:
            raise ValueError(f"{metadata.root}: episodes must be a non-empty subset of 0..{n_total - 1}, got invalid {invalid}")
        self.metadata = metadata
        self.n_obs_steps = n_obs_steps
        self.action_horizon = action_horizon
        self.tolerance_s = tolerance_s
        self.cache_bytes = int(decode_cache_mb * 2**20)
        self.state_normalizer = Normalizer.from_stats(state_norm, metadata.stats[STATE_KEY], STATE_KEY)
        self.action_normalizer = Normalizer.from_stats(action_norm, metadata.stats[ACTION_KEY], ACTION_KEY)

        data = [metadata.read_episode(e) for e in self.episodes]
        lengths = np.array([len(d.state) for d in data])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # Per-row arrays over the concatenated episodes; a sample's window stays inside its episode's rows.
        self._state = self.state_normalizer.normalize(np.concatenate([d.state for d in data])).astype(np.float32)
        self._action = self.action_normalizer.normalize(np.concatenate([d.action for d in data])).astype(np.float32)
        self._timestamp = np.concatenate([d.timestamp for d in data])
        self._frame_index = np.concatenate([d.frame_index for d in data])
        self._sample_id = np.concatenate([d.global_index for d in data])
        self._task_index = np.concatenate([d.task_index for d in data])
        self._episode_index = np.repeat(self.episodes, lengths)
        self._episode_start = np.repeat(starts, lengths)
        self._episode_length = np.repeat(lengths, lengths)
        self._videos: DecodedVideoCache | None = None

    def __len__(self) -> int:
        return len(self._state)

    def __getstate__(self) -> dict[str, Any]:
        # Each worker process decodes into its own cache; don't ship decoded frames between processes.
        return {**self.__dict__, "_videos": None}

    def __getitem__(self, row: int) -> dict[str, Any]:
        if not 0 <= row < len(self):
            raise IndexError(f"sample {row} out of range for {len(self)} samples")
        start, length = self._episode_start[row], self._episode_length[row]
        t = row - start
        obs_steps = t - self.n_obs_steps + 1 + np.arange(self.n_obs_steps)
        obs_rows = start + np.maximum(obs_steps, 0)  # before the episode start: repeat the first frame
        action_steps = t + np.arange(self.action_horizon)
        action_rows = start + np.minimum(action_steps, length - 1)  # past the end: repeat the last action
        episode = int(self._episode_index[row])
        images = np.stack(
            [
                self._video(episode, camera).frames_at(self._timestamp[obs_rows], self.tolerance_s)
                for camera in self.metadata.cameras
            ],
            axis=1,
        )
        return {
            "images": torch.from_numpy(images),
            "obs_mask": torch.from_numpy(obs_steps >= 0),
            "state": torch.from_numpy(self._state[obs_rows]),
            "actions": torch.from_numpy(self._action[action_rows]),
            "action_mask": torch.from_numpy(action_steps < length),
            "instruction": self.metadata.tasks[self._task_index[row]],
            "episode_index": torch.tensor(episode, dtype=torch.int64),
            "frame_index": torch.tensor(int(self._frame_index[row]), dtype=torch.int64),
            "sample_id": torch.tensor(int(self._sample_id[row]), dtype=torch.int64),
        }

    def _video(self, episode: int, camera: str) -> DecodedVideo:
        if self._videos is None:
            self._videos = DecodedVideoCache(self.cache_bytes)
        return self._videos.get(self.metadata.video_path(episode, camera))
