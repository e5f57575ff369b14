"""One sample per frame of a LeRobot dataset, in the batch contract of spec.py, read through bounded caches.

A sample holds the observations and actions at offsets in seconds from its own frame (LeRobot's
delta timestamps). Offsets outside the episode repeat the edge frame and are masked out. Every
requested time must exist within a tolerance, in the parquet timestamps and in the video;
otherwise the error names the episode, the file and the time.

Memory is bounded whatever the dataset size: open files (parquet and video readers) sit in an LRU
of at most `max_open_files`, decoded frames and episodes' low-dimensional columns in an LRU of at
most `decode_cache_mb`. No file is reopened per sample while it stays in the LRU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from uma_lightning.data.cache import LRU
from uma_lightning.data.frame_store import FrameStore
from uma_lightning.data.lerobot import ACTION_KEY, ENV_STATE_KEY, STATE_KEY, DatasetError, EpisodeData, LeRobotMetadata
from uma_lightning.data.video import CudaVideoReader, VideoError, VideoReader

NormMode = Literal["mean_std", "min_max", "quantile"]
# The two statistics each normalisation mode is built from.
MODE_STATISTICS: dict[str, tuple[str, str]] = {
    "mean_std": ("mean", "std"),
    "min_max": ("min", "max"),
    "quantile": ("q01", "q99"),
}
ArrayLike = TypeVar("ArrayLike", np.ndarray, torch.Tensor)
# Errors that mean "this sample's data is bad", as opposed to a bug or a bad config.
BAD_DATA_ERRORS = (DatasetError, VideoError)
# The share of the decoded-frame cache that held frames (those the next batches show) may fill; the
# rest keeps episode columns and recent frames.
HELD_SHARE = 0.75
_INHERITED: list = []  # caches a forked process inherited (see FrameDataset._caches)


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
        return cls(
            values["mode"],
            np.asarray(values["offset"], dtype=np.float32),
            np.asarray(values["scale"], dtype=np.float32),
        )

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


@dataclass(frozen=True)
class Window:
    """The times a sample covers, as offsets in seconds from its frame (LeRobot's delta_timestamps)."""

    observation: tuple[float, ...]
    action: tuple[float, ...]

    @classmethod
    def of_steps(cls, n_obs_steps: int, action_horizon: int, fps: float) -> Window:
        """History of `n_obs_steps` frames ending at the sample's frame; `action_horizon` actions from it."""
        if n_obs_steps < 1 or action_horizon < 1:
            raise ValueError(f"n_obs_steps and action_horizon must be >= 1, got {n_obs_steps}, {action_horizon}")
        return cls(
            tuple((k - n_obs_steps + 1) / fps for k in range(n_obs_steps)),
            tuple(k / fps for k in range(action_horizon)),
        )


class FrameDataset(Dataset):
    """One sample per frame of the selected episodes of one dataset, as a dict following spec.py.

    `len(dataset)` samples, addressed by row: rows run through the selected episodes in order.
    Picklable and light: each process builds its own caches on first use.
    """

    def __init__(
        self,
        metadata: LeRobotMetadata,
        episodes: Sequence[int] | None = None,
        n_obs_steps: int = 1,
        action_horizon: int = 8,
        state_norm: NormMode = "mean_std",
        action_norm: NormMode = "min_max",
        decode_cache_mb: float = 512,
        tolerance_s: float = 1e-4,
        max_open_files: int = 64,
        window: Window | None = None,
        dataset_index: int = 0,
        environment_state: bool = False,
        image_size: tuple[int, int] | None = None,
        decoder_threads: int = 1,
        frame_store: FrameStore | None = None,
        decoder: str = "cpu",
    ) -> None:
        n_total = len(metadata.episodes)
        self.episodes = tuple(range(n_total)) if episodes is None else tuple(int(e) for e in episodes)
        invalid = [e for e in self.episodes if not 0 <= e < n_total]
        if invalid or not self.episodes:
            raise ValueError(
                f"{metadata.root}: episodes must be a non-empty subset of 0..{n_total - 1}, got invalid {invalid}"
            )
        if max_open_files < 1:
            raise ValueError(f"max_open_files must be >= 1, got {max_open_files}")
        self.metadata = metadata
        self.window = window or Window.of_steps(n_obs_steps, action_horizon, metadata.fps)
        self.obs_offsets = np.rint(np.asarray(self.window.observation) * metadata.fps).astype(np.int64)
        self.action_offsets = np.rint(np.asarray(self.window.action) * metadata.fps).astype(np.int64)
        self.tolerance_s = tolerance_s
        self.cache_bytes = int(decode_cache_mb * 2**20)
        self.max_open_files = max_open_files
        self.dataset_index = dataset_index
        # Frames are decoded at `image_size` (scaled in the decoder's colour conversion) when it is given.
        self.decode_size = tuple(image_size) if image_size is not None else None
        self.image_size = tuple(self.decode_size or metadata.image_size)
        self.decoder_threads = decoder_threads
        self.frame_store = frame_store
        self.reader_class = CudaVideoReader if decoder == "cuda" else VideoReader
        self.state_normalizer = Normalizer.from_stats(state_norm, metadata.stats[STATE_KEY], STATE_KEY)
        self.action_normalizer = Normalizer.from_stats(action_norm, metadata.stats[ACTION_KEY], ACTION_KEY)
        self.environment_state_normalizer = None  # samples carry the current frame's environment state when set
        if environment_state:
            if not metadata.environment_state_dim or ENV_STATE_KEY not in metadata.stats:
                raise DatasetError(
                    f"{metadata.root}: no {ENV_STATE_KEY!r} feature with statistics, which the environment-state loss needs"
                )
            self.environment_state_normalizer = Normalizer.from_stats(
                "mean_std", metadata.stats[ENV_STATE_KEY], ENV_STATE_KEY
            )
        self.lengths = np.array([metadata.episodes[e].length for e in self.episodes], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self._pid: int | None = None
        self._files: LRU | None = None
        self._decoded: LRU | None = None

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def __getstate__(self) -> dict[str, Any]:
        # Each process opens its own files and decodes into its own cache.
        return {**self.__dict__, "_pid": None, "_files": None, "_decoded": None}

    def locate(self, row: int) -> tuple[int, int]:
        """(episode index, frame in the episode) of a row."""
        position = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.episodes[position], int(row - self.starts[position])

    def files_of(self, rows: Sequence[int]) -> list[str]:
        """Relative paths of the files the given rows are read from."""
        episodes = {self.locate(int(row))[0] for row in rows}
        return sorted({path for e in episodes for path in self.metadata.episode_files(e)})

    @property
    def images_shape(self) -> tuple[int, ...]:
        """A sample's images: [observation steps, cameras, height, width, 3]."""
        return (len(self.obs_offsets), len(self.metadata.cameras), *self.image_size, 3)

    def __getitem__(self, row: int) -> dict[str, Any]:
        return self.sample(row)

    def sample(self, row: int, images: torch.Tensor | None = None) -> dict[str, Any]:
        """Sample `row`; its frames are written into `images` (uint8 `images_shape`, a batch's slot)
        when it is given, so that collation does not copy them again."""
        if not 0 <= row < len(self):
            raise IndexError(f"sample {row} out of range for {len(self)} samples")
        if images is None:
            images = torch.empty(self.images_shape, dtype=torch.uint8)
        elif tuple(images.shape) != self.images_shape or images.dtype != torch.uint8:
            raise ValueError(
                f"{self.metadata.root}: sample images must be uint8 {self.images_shape}, got {images.dtype} {tuple(images.shape)}"
            )
        episode, t = self.locate(row)
        data = self._episode(episode)
        length = len(data.timestamp)
        obs_steps, action_steps = t + self.obs_offsets, t + self.action_offsets
        obs_rows = np.clip(obs_steps, 0, length - 1)  # outside the episode: repeat the edge frame, masked out
        action_rows = np.clip(action_steps, 0, length - 1)
        obs_mask = (obs_steps >= 0) & (obs_steps < length)
        action_mask = (action_steps >= 0) & (action_steps < length)
        self._check_times(episode, data, t, obs_rows, obs_mask, self.window.observation)
        self._check_times(episode, data, t, action_rows, action_mask, self.window.action)
        pixels = images.numpy()
        for c, camera in enumerate(self.metadata.cameras):
            self._frames(episode, camera, data.timestamp[obs_rows], pixels[:, c])
        sample = {
            "images": images,
            "obs_mask": torch.from_numpy(obs_mask),
            "state": torch.from_numpy(data.state[obs_rows]),
            "actions": torch.from_numpy(data.action[action_rows]),
            "action_mask": torch.from_numpy(action_mask),
            "instruction": self.metadata.tasks[data.task_index[t]],
            "episode_index": torch.tensor(episode, dtype=torch.int64),
            "frame_index": torch.tensor(t, dtype=torch.int64),
            "sample_id": torch.tensor(int(data.global_index[t]), dtype=torch.int64),
            "dataset_index": torch.tensor(self.dataset_index, dtype=torch.int64),
        }
        if data.environment_state is not None:
            sample["environment_state"] = torch.from_numpy(data.environment_state[t])
        return sample

    # ---- reading through the caches ------------------------------------------------------------

    def _caches(self) -> tuple[LRU, LRU]:
        if self._pid != os.getpid():
            # A forked worker inherits the parent's open files, whose file offsets it would share:
            # start fresh in this process. The inherited ones stay referenced, never closed, since
            # freeing FFmpeg state created before the fork can wait forever on threads that did not survive it.
            if self._files is not None:
                _INHERITED.append((self._files, self._decoded))
            self._pid = os.getpid()
            self._files = LRU(self.max_open_files, on_evict=lambda handle: handle.close())
            self._decoded = LRU(self.cache_bytes, cost=lambda value: value.nbytes)
        return self._files, self._decoded

    def _episode(self, episode: int) -> EpisodeData:
        _, decoded = self._caches()

        def load() -> EpisodeData:
            raw = self.metadata.read_episode(episode, open_parquet=self._parquet, tolerance_s=self.tolerance_s)
            return EpisodeData(
                index=episode,
                state=self.state_normalizer.normalize(raw.state).astype(np.float32),
                action=self.action_normalizer.normalize(raw.action).astype(np.float32),
                timestamp=raw.timestamp.astype(np.float64),
                frame_index=raw.frame_index,
                global_index=raw.global_index,
                task_index=raw.task_index,
                environment_state=None
                if self.environment_state_normalizer is None
                else self.environment_state_normalizer.normalize(raw.environment_state).astype(np.float32),
            )

        return decoded.get(("episode", episode), load)

    def _parquet(self, path: Path) -> pq.ParquetFile:
        files, _ = self._caches()
        return files.get(("parquet", str(path)), lambda: _ParquetHandle(path))

    def prepare(self, rows: Sequence[int], later_rows: Sequence[int] = ()) -> None:
        """Decode the frames that samples `rows` need, file by file and in time order, so that each
        file is read forward once; frames passed on the way that samples `later_rows` need are kept
        in the decoded-frame cache too. Reading the samples afterwards finds their frames there."""
        _, decoded = self._caches()
        keep: dict[str, dict[int, int]] = {}  # video file -> frame number -> cache key, of the later samples' frames
        for episode, times in self._requests(later_rows).items():
            for camera in self.metadata.cameras:
                relative, start = self.metadata.episodes[episode].videos[camera]
                in_file = start + times
                frame_numbers = np.rint(in_file * self.metadata.fps).astype(np.int64).tolist()
                keep.setdefault(relative, {}).update(
                    zip(frame_numbers, np.rint(in_file * 1e6).astype(np.int64).tolist())
                )
        wanted = self._requests(rows)
        files = [(episode, camera) for episode in wanted for camera in self.metadata.cameras]
        for episode, camera in sorted(files, key=lambda key: self.metadata.episodes[key[0]].videos[key[1]]):
            relative, start = self.metadata.episodes[episode].videos[camera]
            if self.frame_store is not None and relative in self.frame_store:
                continue
            try:
                self._reader(episode, camera).cache_frames(
                    start + wanted[episode], self.tolerance_s, decoded, keep=keep.get(relative)
                )
            except VideoError as error:
                raise VideoError(f"episode {episode}: {error}") from error

    def hold_frames(self, rows: Sequence[int]) -> None:
        """Mark the decoded frames samples `rows` will show as needed later (see `LRU.hold`)."""
        _, decoded = self._caches()
        for key in self._frame_keys(rows):
            decoded.hold(key)

    def room_to_hold(self) -> bool:
        """Whether the decoded-frame cache has room for more held frames: beyond its capacity,
        holding more would only decide which needed frames go, by when they were held."""
        _, decoded = self._caches()
        return decoded.held_cost < HELD_SHARE * self.cache_bytes

    def release_frames(self, rows: Sequence[int]) -> None:
        """Undo `hold_frames(rows)` once those samples are built."""
        _, decoded = self._caches()
        for key in self._frame_keys(rows):
            decoded.release(key)

    def _frame_keys(self, rows: Sequence[int]) -> list[tuple[str, int]]:
        """The decoded-frame cache's keys of the frames samples `rows` show, each once."""
        keys = []
        for episode, times in self._requests(rows).items():
            for camera in self.metadata.cameras:
                relative, start = self.metadata.episodes[episode].videos[camera]
                if self.frame_store is not None and relative in self.frame_store:
                    continue
                keys += [(relative, micros) for micros in np.rint((start + times) * 1e6).astype(np.int64).tolist()]
        return keys

    def _requests(self, rows: Sequence[int]) -> dict[int, np.ndarray]:
        """episode -> the distinct times (seconds in the episode, sorted) that samples `rows` show, on every camera."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        if not len(rows):
            return {}
        positions = np.searchsorted(self.starts, rows, side="right") - 1
        # Every row's frames at once, clipped to its episode; then split by episode (rows are sorted).
        steps = np.clip(
            (rows - self.starts[positions])[:, None] + self.obs_offsets, 0, (self.lengths[positions] - 1)[:, None]
        )
        splits = np.flatnonzero(np.diff(positions)) + 1
        times = {}
        for position, episode_steps in zip(positions[np.r_[0, splits]].tolist(), np.split(steps, splits)):
            episode = self.episodes[position]
            times[episode] = np.unique(self._episode(episode).timestamp[episode_steps])
        return times

    def _reader(self, episode: int, camera: str) -> VideoReader:
        """The open reader of the episode's video for `camera`, which names its frames in the
        decoded-frame cache by the file's path in the dataset. Only opening one finds the file
        (downloading it when the dataset is remote)."""
        files, _ = self._caches()
        relative = self.metadata.episodes[episode].videos[camera][0]
        return files.get(
            ("video", relative),
            lambda: self.reader_class(
                self.metadata.video_path(episode, camera), self.decoder_threads, self.decode_size, name=relative
            ),
        )

    def _frames(self, episode: int, camera: str, times: np.ndarray, out: np.ndarray) -> None:
        """Write one camera's frames at `times` into `out` [N, H, W, 3]; frames of another size (a
        camera smaller than the dataset's largest) are scaled to it first."""
        _, decoded = self._caches()
        relative, start = self.metadata.episodes[episode].videos[camera]
        try:
            if self.frame_store is not None and relative in self.frame_store:
                same_size = tuple(self.frame_store.size) == self.image_size
                frames = self.frame_store.frames(
                    relative, start + times, self.tolerance_s, out=out if same_size else None
                )
            else:
                reader = self._reader(episode, camera)
                same_size = tuple(reader.size or ()) == self.image_size
                frames = reader.frames_at(
                    start + times, self.tolerance_s, cache=decoded, out=out if same_size else None
                )
        except VideoError as error:
            raise VideoError(f"episode {episode}: {error}") from error
        if frames is not out:
            out[...] = resize_frames(frames, self.image_size)

    def _check_times(
        self, episode: int, data: EpisodeData, t: int, rows: np.ndarray, inside: np.ndarray, offsets: tuple[float, ...]
    ) -> None:
        wanted = data.timestamp[t] + np.asarray(offsets)
        off = inside & (np.abs(data.timestamp[rows] - wanted) > self.tolerance_s)
        if off.any():
            k = int(np.flatnonzero(off)[0])
            raise DatasetError(
                f"episode {episode}: {self.metadata.data_path(episode)}: no frame at timestamp {wanted[k]:.6f}s "
                f"(nearest is {data.timestamp[rows[k]]:.6f}s, tolerance {self.tolerance_s}s)"
            )


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 frames [N, h, w, 3] at (height, width) `size`: a camera smaller than a dataset's largest
    is scaled up (bilinear) so that every camera of a sample has one shape."""
    if frames.shape[1:3] == tuple(size):
        return frames
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    scaled = torch.nn.functional.interpolate(
        pixels, size=tuple(size), mode="bilinear", align_corners=False, antialias=True
    )
    return scaled.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


class _ParquetHandle(pq.ParquetFile):
    """A ParquetFile over a file object this class owns, so that the LRU can close it."""

    def __init__(self, path: Path) -> None:
        self._handle = open(path, "rb")
        try:
            super().__init__(self._handle)
        except BaseException:
            self._handle.close()
            raise

    def close(self, force: bool = False) -> None:
        super().close(force)
        self._handle.close()
