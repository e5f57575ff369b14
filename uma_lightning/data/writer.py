"""Writer and reader for the LeRobot v2.1 on-disk dataset layout (without depending on `lerobot`).

    root/
      meta/info.json              codebase_version, fps, features, path templates, totals, splits
      meta/tasks.jsonl            {"task_index", "task"} per line
      meta/episodes.jsonl         {"episode_index", "tasks", "length"} per line
      meta/episodes_stats.jsonl   {"episode_index", "stats"} per line
      meta/stats.json             aggregate statistics per feature
      data/chunk-000/episode_000000.parquet
      videos/chunk-000/<camera key>/episode_000000.mp4

Statistics per feature are mean, std, min, max, q01, q99 and count. Low-dimensional features get
one value per dimension; cameras get one per channel in [0, 1], shaped [3, 1, 1] as LeRobot does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from uma_lightning.data.video import encode_video

logger = logging.getLogger(__name__)

CODEBASE_VERSION = "v2.1"
CHUNKS_SIZE = 1000
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
INDEX_KEYS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
QUANTILES = {"q01": 0.01, "q99": 0.99}


class DatasetError(RuntimeError):
    """A dataset file is missing, unreadable, or disagrees with meta/info.json."""


# ---------------------------------------------------------------------------------------- schema
def arrow_schema(features: Mapping[str, Any]) -> pa.Schema:
    """The parquet schema that info.json `features` imply: every non-video feature is a column,
    vectors as fixed-size lists."""
    fields = []
    for key, feature in features.items():
        if feature["dtype"] == "video":
            continue
        try:
            scalar = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
        except (TypeError, pa.ArrowNotImplementedError) as error:
            raise DatasetError(f"feature {key!r} has unsupported dtype {feature['dtype']!r}") from error
        shape = list(feature["shape"])
        fields.append(pa.field(key, scalar if shape == [1] else pa.list_(scalar, int(np.prod(shape)))))
    return pa.schema(fields)


# ---------------------------------------------------------------------------------------- stats
def array_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Per-dimension statistics of a [N, D] array, computed in float64."""
    values = np.asarray(values, dtype=np.float64)
    stats = {
        "mean": values.mean(axis=0),
        "std": values.std(axis=0),
        "min": values.min(axis=0),
        "max": values.max(axis=0),
    }
    stats.update({name: np.quantile(values, q, axis=0) for name, q in QUANTILES.items()})
    stats["count"] = np.array([len(values)])
    return stats


def channel_histogram(frames: np.ndarray) -> np.ndarray:
    """Per-channel counts of each uint8 value, [3, 256]; histograms add up across episodes exactly."""
    return np.stack([np.bincount(frames[..., c].ravel(), minlength=256) for c in range(frames.shape[-1])])


def histogram_stats(histogram: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel statistics in [0, 1], shaped [3, 1, 1], from a [3, 256] value histogram.

    Quantiles use the inverted empirical CDF, exact for 8-bit pixels."""
    values = np.arange(histogram.shape[1]) / 255.0
    count = histogram.sum(axis=1)
    mean = histogram @ values / count
    variance = np.maximum(histogram @ values**2 / count - mean**2, 0.0)
    cdf = np.cumsum(histogram, axis=1) / count[:, None]
    present = histogram > 0
    stats = {
        "mean": mean,
        "std": np.sqrt(variance),
        "min": values[present.argmax(axis=1)],
        "max": values[len(values) - 1 - present[:, ::-1].argmax(axis=1)],
    }
    stats.update({name: values[(cdf >= q).argmax(axis=1)] for name, q in QUANTILES.items()})
    stats = {name: value.reshape(-1, 1, 1) for name, value in stats.items()}
    stats["count"] = np.array([int(count[0])])
    return stats


def _stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, list]]:
    return {key: {name: np.asarray(value).tolist() for name, value in s.items()} for key, s in stats.items()}


def _stats_from_json(stats: Mapping[str, Mapping[str, list]]) -> dict[str, dict[str, np.ndarray]]:
    return {key: {name: np.asarray(value) for name, value in s.items()} for key, s in stats.items()}


# ---------------------------------------------------------------------------------------- writer
class LeRobotWriter:
    """Writes episodes into `<root>.partial` and renames it to `root` in `finalize()`.

    A dataset directory therefore either exists complete or not at all: a killed run leaves only
    the `.partial` directory, which the next writer for the same root removes. Writers of the same
    root must not run concurrently (`ensure_dataset` serialises them with a file lock).

    Use as a context manager to discard the partial directory when generation fails.
    """

    def __init__(
        self,
        root: str | Path,
        fps: float,
        cameras: Sequence[str],
        image_size: tuple[int, int],
        state_names: Sequence[str],
        action_names: Sequence[str],
        robot_type: str = "unknown",
        crf: int = 20,
    ) -> None:
        self.root = Path(root)
        if self.root.exists():
            raise FileExistsError(f"dataset directory {self.root} already exists")
        if not cameras:
            raise ValueError("need at least one camera key")
        self.fps = float(fps)
        self.cameras = tuple(cameras)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.robot_type = robot_type
        self.crf = crf
        self.features = self._features(list(state_names), list(action_names))
        self.schema = arrow_schema(self.features)
        self.partial = self.root.with_name(self.root.name + ".partial")
        if self.partial.exists():
            logger.info("removing %s left by an interrupted writer", self.partial)
            shutil.rmtree(self.partial)
        (self.partial / "meta").mkdir(parents=True)
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict[str, Any]] = []
        self._episode_stats: list[dict[str, Any]] = []
        self._states: list[np.ndarray] = []
        self._actions: list[np.ndarray] = []
        self._histograms = {camera: np.zeros((3, 256), dtype=np.int64) for camera in self.cameras}
        self._total_frames = 0

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.partial, ignore_errors=True)

    def add_episode(
        self, frames: Mapping[str, np.ndarray], state: np.ndarray, action: np.ndarray, task: str
    ) -> int:
        """Write one episode: per-camera uint8 frames [T, H, W, 3], state [T, state_dim],
        action [T, action_dim] and its instruction. Returns the episode index."""
        episode_index = len(self._episodes)
        state, action = self._check_episode(episode_index, frames, state, action, task)
        length = len(state)
        task_index = self._tasks.setdefault(task, len(self._tasks))
        frame_index = np.arange(length, dtype=np.int64)
        columns = {
            STATE_KEY: state,
            ACTION_KEY: action,
            "timestamp": (frame_index / self.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.full(length, episode_index, dtype=np.int64),
            "index": self._total_frames + frame_index,
            "task_index": np.full(length, task_index, dtype=np.int64),
        }
        data_path = self.partial / self._format(DATA_PATH, episode_index)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table([_to_arrow(columns[f.name], f.type) for f in self.schema], schema=self.schema), data_path)

        stats = {STATE_KEY: array_stats(state), ACTION_KEY: array_stats(action)}
        for camera in self.cameras:
            video_path = self.partial / self._format(VIDEO_PATH, episode_index, camera)
            video_path.parent.mkdir(parents=True, exist_ok=True)
            encode_video(frames[camera], video_path, self.fps, crf=self.crf)
            histogram = channel_histogram(frames[camera])
            self._histograms[camera] += histogram
            stats[camera] = histogram_stats(histogram)

        self._states.append(state)
        self._actions.append(action)
        self._episodes.append({"episode_index": episode_index, "tasks": [task], "length": length})
        self._episode_stats.append({"episode_index": episode_index, "stats": _stats_to_json(stats)})
        self._total_frames += length
        return episode_index

    def finalize(self) -> Path:
        """Write the metadata (info.json last) and move the dataset into place."""
        if not self._episodes:
            raise ValueError(f"{self.root}: cannot finalize a dataset without episodes")
        meta = self.partial / "meta"
        stats = {
            STATE_KEY: array_stats(np.concatenate(self._states)),
            ACTION_KEY: array_stats(np.concatenate(self._actions)),
        }
        stats.update({camera: histogram_stats(h) for camera, h in self._histograms.items()})
        _write_json(meta / "stats.json", _stats_to_json(stats))
        _write_jsonl(meta / "tasks.jsonl", [{"task_index": i, "task": t} for t, i in self._tasks.items()])
        _write_jsonl(meta / "episodes.jsonl", self._episodes)
        _write_jsonl(meta / "episodes_stats.jsonl", self._episode_stats)
        n_episodes = len(self._episodes)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": n_episodes,
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "total_videos": n_episodes * len(self.cameras),
            "total_chunks": (n_episodes - 1) // CHUNKS_SIZE + 1,
            "chunks_size": CHUNKS_SIZE,
            "fps": self.fps,
            "splits": {"train": f"0:{n_episodes}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH,
            "features": self.features,
        }
        _write_json(meta / "info.json", info)
        os.rename(self.partial, self.root)
        logger.info("wrote %d episodes, %d frames to %s", n_episodes, self._total_frames, self.root)
        return self.root

    def _features(self, state_names: list[str], action_names: list[str]) -> dict[str, Any]:
        height, width = self.image_size
        video_info = {
            "video.fps": self.fps,
            "video.height": height,
            "video.width": width,
            "video.channels": 3,
            "video.codec": "h264",
            "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False,
            "has_audio": False,
        }
        features: dict[str, Any] = {
            camera: {
                "dtype": "video",
                "shape": [height, width, 3],
                "names": ["height", "width", "channels"],
                "info": video_info,
            }
            for camera in self.cameras
        }
        features[STATE_KEY] = {"dtype": "float32", "shape": [len(state_names)], "names": state_names}
        features[ACTION_KEY] = {"dtype": "float32", "shape": [len(action_names)], "names": action_names}
        features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
        for key in INDEX_KEYS[1:]:
            features[key] = {"dtype": "int64", "shape": [1], "names": None}
        return features

    def _check_episode(
        self, episode: int, frames: Mapping[str, np.ndarray], state: Any, action: Any, task: str
    ) -> tuple[np.ndarray, np.ndarray]:
        where = f"{self.root} episode {episode}"
        if not isinstance(task, str) or not task.strip():
            raise ValueError(f"{where}: task must be a non-empty string, got {task!r}")
        state = np.asarray(state, dtype=np.float32)
        action = np.asarray(action, dtype=np.float32)
        for key, values in ((STATE_KEY, state), (ACTION_KEY, action)):
            expected = self.features[key]["shape"][0]
            if values.ndim != 2 or values.shape[1] != expected or len(values) == 0:
                raise ValueError(f"{where}: {key} must be [T >= 1, {expected}], got {values.shape}")
            if not np.all(np.isfinite(values)):
                raise ValueError(f"{where}: {key} contains non-finite values")
        if len(action) != len(state):
            raise ValueError(f"{where}: {len(state)} states but {len(action)} actions")
        if set(frames) != set(self.cameras):
            raise ValueError(f"{where}: frames for cameras {sorted(frames)}, expected {sorted(self.cameras)}")
        for camera, images in frames.items():
            expected_shape = (len(state), *self.image_size, 3)
            if images.dtype != np.uint8 or images.shape != expected_shape:
                raise ValueError(
                    f"{where}: {camera} frames must be uint8 {expected_shape}, got {images.dtype} {images.shape}"
                )
        return state, action

    def _format(self, template: str, episode_index: int, camera: str = "") -> str:
        return template.format(
            episode_chunk=episode_index // CHUNKS_SIZE, episode_index=episode_index, video_key=camera
        )


def _to_arrow(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), arrow_type.list_size)
    return pa.array(values, type=arrow_type)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---------------------------------------------------------------------------------------- reader
@dataclass(frozen=True)
class EpisodeInfo:
    index: int
    length: int
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class EpisodeData:
    """The low-dimensional columns of one episode's parquet file."""

    index: int
    state: np.ndarray  # float32 [T, state_dim]
    action: np.ndarray  # float32 [T, action_dim]
    timestamp: np.ndarray  # float32 [T]
    frame_index: np.ndarray  # int64 [T]
    global_index: np.ndarray  # int64 [T], the "index" column
    task_index: np.ndarray  # int64 [T]


@dataclass(frozen=True)
class LeRobotMetadata:
    """The meta/ files of a LeRobot v2.1 dataset, plus access to its per-episode files."""

    root: Path
    info: dict[str, Any]
    tasks: tuple[str, ...]  # by task_index
    episodes: tuple[EpisodeInfo, ...]  # by episode_index
    stats: dict[str, dict[str, np.ndarray]]

    @classmethod
    def load(cls, root: str | Path) -> LeRobotMetadata:
        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"dataset root {root} is not a directory")
        info_path = root / "meta" / "info.json"
        info = _read_json(info_path)
        for key in ("codebase_version", "fps", "features", "data_path", "video_path", "total_episodes"):
            if key not in info:
                raise DatasetError(f"{info_path}: missing key {key!r}")
        if info["codebase_version"] != CODEBASE_VERSION:
            raise DatasetError(
                f"{info_path}: codebase_version is {info['codebase_version']!r}, this reader supports {CODEBASE_VERSION!r}"
            )
        for key in (STATE_KEY, ACTION_KEY):
            if key not in info["features"]:
                raise DatasetError(f"{info_path}: features lack {key!r}")
        try:
            arrow_schema(info["features"])
        except (DatasetError, KeyError, TypeError) as error:
            raise DatasetError(f"{info_path}: malformed features: {error}") from error

        tasks_path = root / "meta" / "tasks.jsonl"
        task_rows = sorted(_read_jsonl(tasks_path, ("task_index", "task")), key=lambda row: row["task_index"])
        if [row["task_index"] for row in task_rows] != list(range(len(task_rows))):
            raise DatasetError(f"{tasks_path}: task_index values are not 0..{len(task_rows) - 1}")

        episodes_path = root / "meta" / "episodes.jsonl"
        episode_rows = _read_jsonl(episodes_path, ("episode_index", "tasks", "length"))
        episodes = tuple(
            EpisodeInfo(int(row["episode_index"]), int(row["length"]), tuple(row["tasks"]))
            for row in sorted(episode_rows, key=lambda row: row["episode_index"])
        )
        if [e.index for e in episodes] != list(range(info["total_episodes"])):
            raise DatasetError(
                f"{episodes_path}: episode_index values are not 0..{info['total_episodes'] - 1} as info.json says"
            )

        stats_path = root / "meta" / "stats.json"
        stats = _stats_from_json(_read_json(stats_path))
        for key in (STATE_KEY, ACTION_KEY):
            if key not in stats:
                raise DatasetError(f"{stats_path}: no statistics for {key!r}")
        return cls(root, info, tuple(row["task"] for row in task_rows), episodes, stats)

    @property
    def fps(self) -> float:
        return float(self.info["fps"])

    @property
    def features(self) -> dict[str, Any]:
        return self.info["features"]

    @property
    def cameras(self) -> tuple[str, ...]:
        return tuple(key for key, feature in self.features.items() if feature["dtype"] == "video")

    @property
    def image_size(self) -> tuple[int, int]:
        shapes = {tuple(self.features[camera]["shape"][:2]) for camera in self.cameras}
        if len(shapes) != 1:
            raise DatasetError(f"{self.root / 'meta' / 'info.json'}: cameras have different shapes {sorted(shapes)}")
        return shapes.pop()

    @property
    def state_dim(self) -> int:
        return int(self.features[STATE_KEY]["shape"][0])

    @property
    def action_dim(self) -> int:
        return int(self.features[ACTION_KEY]["shape"][0])

    def data_path(self, episode_index: int) -> Path:
        return self.root / self.info["data_path"].format(
            episode_chunk=episode_index // self.info.get("chunks_size", CHUNKS_SIZE), episode_index=episode_index
        )

    def video_path(self, episode_index: int, camera: str) -> Path:
        return self.root / self.info["video_path"].format(
            episode_chunk=episode_index // self.info.get("chunks_size", CHUNKS_SIZE),
            episode_index=episode_index,
            video_key=camera,
        )

    def read_episode(self, episode_index: int) -> EpisodeData:
        """Load and check one episode's parquet file against info.json and episodes.jsonl."""
        path = self.data_path(episode_index)
        if not path.is_file():
            raise DatasetError(f"episode {episode_index}: data file {path} is missing")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            raise DatasetError(f"episode {episode_index}: cannot read parquet file {path}: {error}") from error
        for field in arrow_schema(self.features):
            if field.name not in table.column_names:
                raise DatasetError(f"{path}: column {field.name!r} declared in meta/info.json is missing")
            actual = _canonical_type(table.schema.field(field.name).type)
            if actual != field.type:
                raise DatasetError(f"{path}: column {field.name!r} has type {actual}, meta/info.json declares {field.type}")
            if table.column(field.name).null_count:
                raise DatasetError(f"{path}: column {field.name!r} contains nulls")
        columns = {name: _to_numpy(table.column(name)) for name in (STATE_KEY, ACTION_KEY, *INDEX_KEYS)}
        expected_length = self.episodes[episode_index].length
        if table.num_rows != expected_length:
            raise DatasetError(f"{path}: {table.num_rows} rows, meta/episodes.jsonl says {expected_length}")
        if not np.array_equal(columns["frame_index"], np.arange(expected_length)):
            raise DatasetError(f"{path}: frame_index is not 0..{expected_length - 1}")
        if np.any(columns["episode_index"] != episode_index):
            raise DatasetError(f"{path}: episode_index column differs from {episode_index}")
        if np.any((columns["task_index"] < 0) | (columns["task_index"] >= len(self.tasks))):
            raise DatasetError(f"{path}: task_index outside 0..{len(self.tasks) - 1}")
        return EpisodeData(
            index=episode_index,
            state=columns[STATE_KEY],
            action=columns[ACTION_KEY],
            timestamp=columns["timestamp"],
            frame_index=columns["frame_index"],
            global_index=columns["index"],
            task_index=columns["task_index"],
        )


def _canonical_type(arrow_type: pa.DataType) -> pa.DataType:
    """Writers name a list's child field differently ("item", "element"); only its type and size matter."""
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.list_(arrow_type.value_type, arrow_type.list_size)
    return arrow_type


def _to_numpy(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        return array.flatten().to_numpy().reshape(len(array), array.type.list_size)
    return array.to_numpy()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DatasetError(f"{path} is missing") from error
    except (OSError, json.JSONDecodeError) as error:
        raise DatasetError(f"cannot read {path}: {error}") from error


def _read_jsonl(path: Path, required_keys: Sequence[str]) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError as error:
        raise DatasetError(f"{path} is missing") from error
    except OSError as error:
        raise DatasetError(f"cannot read {path}: {error}") from error
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}:{number}: {error}") from error
            missing = [key for key in required_keys if key not in row]
            if missing:
                raise DatasetError(f"{path}:{number}: missing key(s) {missing}")
            rows.append(row)
    return rows
