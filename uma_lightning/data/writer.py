"""Writer of LeRobot datasets in the v2.1 or v3.0 layout (see lerobot.py for both), readable by LeRobot itself.

Statistics (meta/stats.json and per episode) come from the arrays being written, so writing never
decodes video. v3.0 files hold consecutive episodes and start a new file past a size limit; each
episode is one parquet row group, so reading an episode reads only its own rows.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from uma_lightning.data.lerobot import (
    ACTION_KEY,
    CHUNKS_SIZE,
    ENV_STATE_KEY,
    INDEX_KEYS,
    STATE_KEY,
    V2_DATA_PATH,
    V2_VIDEO_PATH,
    V3_DATA_PATH,
    V3_EPISODES_PATH,
    V3_VIDEO_PATH,
    VECTOR_KEYS,
    arrow_schema,
)
from uma_lightning.data.stats import array_stats, channel_histogram, histogram_stats, stats_to_json
from uma_lightning.data.video import VideoStreamWriter

logger = logging.getLogger(__name__)

Version = Literal["v2.1", "v3.0"]


class LeRobotWriter:
    """Writes episodes into `<root>.partial` and renames it to `root` in `finalize()`.

    A dataset directory therefore either exists complete or not at all: a killed run leaves only
    the `.partial` directory, which the next writer for the same root removes. Writers of the same
    root must not run concurrently (`ensure_dataset` serialises them with a file lock).

    Use as a context manager to discard the partial directory when writing fails.
    """

    def __init__(
        self,
        root: str | Path,
        fps: float,
        cameras: Sequence[str],
        image_size: tuple[int, int],
        state_names: Sequence[str],
        action_names: Sequence[str],
        environment_state_names: Sequence[str] = (),
        robot_type: str = "unknown",
        crf: int = 20,
        version: Version = "v2.1",
        codec: str = "h264",
        gop: int = 2,
        data_file_mb: float = 100.0,
        video_file_mb: float = 500.0,
    ) -> None:
        self.root = Path(root)
        if self.root.exists():
            raise FileExistsError(f"dataset directory {self.root} already exists")
        if not cameras:
            raise ValueError("need at least one camera key")
        if version not in ("v2.1", "v3.0"):
            raise ValueError(f"cannot write LeRobot version {version!r}; choose v2.1 or v3.0")
        self.fps = float(fps)
        self.cameras = tuple(cameras)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.robot_type = robot_type
        self.crf = crf
        self.codec, self.gop = codec, gop
        self.version = version
        self.data_file_bytes = int(data_file_mb * 2**20)
        self.video_file_bytes = int(video_file_mb * 2**20)
        self.features = self._features(list(state_names), list(action_names), list(environment_state_names))
        # The float vectors every frame has, whose statistics meta/stats.json keeps.
        self.vector_keys = tuple(key for key in VECTOR_KEYS if key in self.features)
        self.schema = arrow_schema(self.features)
        self.partial = self.root.with_name(self.root.name + ".partial")
        if self.partial.exists():
            logger.info("removing %s left by an interrupted writer", self.partial)
            shutil.rmtree(self.partial)
        (self.partial / "meta").mkdir(parents=True)
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict[str, Any]] = []
        self._episode_stats: list[dict[str, Any]] = []
        self._vectors: dict[str, list[np.ndarray]] = {key: [] for key in self.vector_keys}
        self._histograms = {camera: np.zeros((3, 256), dtype=np.int64) for camera in self.cameras}
        self._total_frames = 0
        # v3.0: the open data file and one open video file per camera, with their (chunk, file) indices.
        self._data_writer: pq.ParquetWriter | None = None
        self._data_file, self._data_bytes = (0, 0), 0
        self._videos: dict[str, tuple[VideoStreamWriter, tuple[int, int]]] = {}

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is not None:
            self._close_files()
            shutil.rmtree(self.partial, ignore_errors=True)

    def add_episode(
        self,
        frames: Mapping[str, np.ndarray],
        state: np.ndarray,
        action: np.ndarray,
        task: str,
        environment_state: np.ndarray | None = None,
    ) -> int:
        """Write one episode: per-camera uint8 frames [T, H, W, 3], state [T, state_dim],
        action [T, action_dim], its instruction and, when the writer was given
        ``environment_state_names``, the environment state [T, environment_state_dim].
        Returns the episode index."""
        episode_index = len(self._episodes)
        vectors = self._check_episode(
            episode_index, frames, {STATE_KEY: state, ACTION_KEY: action, ENV_STATE_KEY: environment_state}, task
        )
        length = len(vectors[STATE_KEY])
        task_index = self._tasks.setdefault(task, len(self._tasks))
        frame_index = np.arange(length, dtype=np.int64)
        columns = {
            **vectors,
            "timestamp": (frame_index / self.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.full(length, episode_index, dtype=np.int64),
            "index": self._total_frames + frame_index,
            "task_index": np.full(length, task_index, dtype=np.int64),
        }
        table = pa.table([_to_arrow(columns[f.name], f.type) for f in self.schema], schema=self.schema)
        stats = {key: array_stats(values) for key, values in vectors.items()}
        row: dict[str, Any] = {"episode_index": episode_index, "tasks": [task], "length": length}
        if self.version == "v2.1":
            data_path = self.partial / self._v2_path(V2_DATA_PATH, episode_index)
            data_path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, data_path)
        else:
            row.update(self._append_data(table))
        for camera in self.cameras:
            if self.version == "v2.1":
                video_path = self.partial / self._v2_path(V2_VIDEO_PATH, episode_index, camera)
                video_path.parent.mkdir(parents=True, exist_ok=True)
                with VideoStreamWriter(
                    video_path, self.fps, *self.image_size, crf=self.crf, gop=self.gop, codec=self.codec
                ) as video:
                    video.add(frames[camera])
            else:
                row.update(self._append_video(camera, frames[camera]))
            histogram = channel_histogram(frames[camera])
            self._histograms[camera] += histogram
            stats[camera] = histogram_stats(histogram)

        for key, values in vectors.items():
            self._vectors[key].append(values)
        self._episodes.append(row)
        self._episode_stats.append({"episode_index": episode_index, "stats": stats_to_json(stats)})
        self._total_frames += length
        return episode_index

    def finalize(self) -> Path:
        """Write the metadata (info.json last) and move the dataset into place."""
        if not self._episodes:
            raise ValueError(f"{self.root}: cannot finalize a dataset without episodes")
        self._close_files()
        meta = self.partial / "meta"
        stats = {key: array_stats(np.concatenate(values)) for key, values in self._vectors.items()}
        stats.update({camera: histogram_stats(h) for camera, h in self._histograms.items()})
        _write_json(meta / "stats.json", stats_to_json(stats))
        if self.version == "v2.1":
            _write_jsonl(meta / "tasks.jsonl", [{"task_index": i, "task": t} for t, i in self._tasks.items()])
            _write_jsonl(meta / "episodes.jsonl", self._episodes)
            _write_jsonl(meta / "episodes_stats.jsonl", self._episode_stats)
        else:
            _write_tasks_parquet(meta / "tasks.parquet", self._tasks)
            self._write_episodes_parquet()
        n_episodes = len(self._episodes)
        info = {
            "codebase_version": self.version,
            "robot_type": self.robot_type,
            "total_episodes": n_episodes,
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": CHUNKS_SIZE,
            "fps": self.fps,
            "splits": {"train": f"0:{n_episodes}"},
            "features": self.features,
        }
        if self.version == "v2.1":
            info.update(
                total_videos=n_episodes * len(self.cameras),
                total_chunks=(n_episodes - 1) // CHUNKS_SIZE + 1,
                data_path=V2_DATA_PATH,
                video_path=V2_VIDEO_PATH,
            )
        else:
            info.update(
                data_files_size_in_mb=self.data_file_bytes / 2**20,
                video_files_size_in_mb=self.video_file_bytes / 2**20,
                data_path=V3_DATA_PATH,
                video_path=V3_VIDEO_PATH,
            )
        _write_json(meta / "info.json", info)
        os.rename(self.partial, self.root)
        logger.info(
            "wrote %d episodes, %d frames to %s (LeRobot %s)", n_episodes, self._total_frames, self.root, self.version
        )
        return self.root

    # ---- v3.0 files ----------------------------------------------------------------------------

    def _append_data(self, table: pa.Table) -> dict[str, Any]:
        if self._data_writer is not None and self._data_bytes >= self.data_file_bytes:
            self._data_writer.close()
            self._data_writer, self._data_file, self._data_bytes = None, _next_file(self._data_file), 0
        if self._data_writer is None:
            path = self.partial / V3_DATA_PATH.format(chunk_index=self._data_file[0], file_index=self._data_file[1])
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = pq.ParquetWriter(path, self.schema)
        self._data_writer.write_table(table, row_group_size=table.num_rows)  # one row group per episode
        self._data_bytes += table.nbytes
        start = self._total_frames
        return {
            "data/chunk_index": self._data_file[0],
            "data/file_index": self._data_file[1],
            "dataset_from_index": start,
            "dataset_to_index": start + table.num_rows,
        }

    def _append_video(self, camera: str, frames: np.ndarray) -> dict[str, Any]:
        video, chunk_file = self._videos.get(camera, (None, (0, -1)))
        # An encoder with lookahead (SVT-AV1) may not have written the file yet.
        if video is None or (video.path.exists() and video.path.stat().st_size >= self.video_file_bytes):
            if video is not None:
                video.close()
            chunk_file = _next_file(chunk_file) if video is not None else (0, 0)
            path = self.partial / V3_VIDEO_PATH.format(
                video_key=camera, chunk_index=chunk_file[0], file_index=chunk_file[1]
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            video = VideoStreamWriter(path, self.fps, *self.image_size, crf=self.crf, gop=self.gop, codec=self.codec)
            self._videos[camera] = (video, chunk_file)
        start, end = video.add(frames)
        prefix = f"videos/{camera}"
        return {
            f"{prefix}/chunk_index": chunk_file[0],
            f"{prefix}/file_index": chunk_file[1],
            f"{prefix}/from_timestamp": start,
            f"{prefix}/to_timestamp": end,
        }

    def _close_files(self) -> None:
        if self._data_writer is not None:
            self._data_writer.close()
            self._data_writer = None
        for video, _ in self._videos.values():
            video.close()
        self._videos = {}

    def _write_episodes_parquet(self) -> None:
        rows = []
        for row, episode_stats in zip(self._episodes, self._episode_stats):
            flat = {
                f"stats/{key}/{name}": np.asarray(value, dtype=np.float64).reshape(-1).tolist()
                for key, values in episode_stats["stats"].items()
                for name, value in values.items()
            }
            rows.append({**row, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0, **flat})
        path = self.partial / V3_EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)

    # ---- checks and layout ---------------------------------------------------------------------

    def _features(
        self, state_names: list[str], action_names: list[str], environment_state_names: list[str]
    ) -> dict[str, Any]:
        height, width = self.image_size
        video_info = {
            "video.fps": self.fps,
            "video.height": height,
            "video.width": width,
            "video.channels": 3,
            "video.codec": self.codec,
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
        if environment_state_names:
            features[ENV_STATE_KEY] = {
                "dtype": "float32",
                "shape": [len(environment_state_names)],
                "names": environment_state_names,
            }
        features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
        for key in INDEX_KEYS[1:]:
            features[key] = {"dtype": "int64", "shape": [1], "names": None}
        return features

    def _check_episode(
        self, episode: int, frames: Mapping[str, np.ndarray], given: Mapping[str, Any], task: str
    ) -> dict[str, np.ndarray]:
        where = f"{self.root} episode {episode}"
        if not isinstance(task, str) or not task.strip():
            raise ValueError(f"{where}: task must be a non-empty string, got {task!r}")
        extra = [key for key, values in given.items() if values is not None and key not in self.vector_keys]
        if extra:
            raise ValueError(f"{where}: {extra[0]} given, but the writer was created without its names")
        vectors = {}
        for key in self.vector_keys:
            if given[key] is None:
                raise ValueError(f"{where}: {key} is missing")
            values = vectors[key] = np.asarray(given[key], dtype=np.float32)
            expected = self.features[key]["shape"][0]
            if values.ndim != 2 or values.shape[1] != expected or len(values) == 0:
                raise ValueError(f"{where}: {key} must be [T >= 1, {expected}], got {values.shape}")
            if not np.all(np.isfinite(values)):
                raise ValueError(f"{where}: {key} contains non-finite values")
            if len(values) != len(vectors[STATE_KEY]):
                rows = "actions" if key == ACTION_KEY else f"rows of {key}"
                raise ValueError(f"{where}: {len(vectors[STATE_KEY])} states but {len(values)} {rows}")
        state = vectors[STATE_KEY]
        if set(frames) != set(self.cameras):
            raise ValueError(f"{where}: frames for cameras {sorted(frames)}, expected {sorted(self.cameras)}")
        for camera, images in frames.items():
            expected_shape = (len(state), *self.image_size, 3)
            if images.dtype != np.uint8 or images.shape != expected_shape:
                raise ValueError(
                    f"{where}: {camera} frames must be uint8 {expected_shape}, got {images.dtype} {images.shape}"
                )
        return vectors

    def _v2_path(self, template: str, episode_index: int, camera: str = "") -> str:
        return template.format(
            episode_chunk=episode_index // CHUNKS_SIZE, episode_index=episode_index, video_key=camera
        )


def _next_file(chunk_file: tuple[int, int]) -> tuple[int, int]:
    chunk, file = chunk_file
    return (chunk + 1, 0) if file + 1 == CHUNKS_SIZE else (chunk, file + 1)


def _to_arrow(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), arrow_type.list_size)
    return pa.array(
        values.reshape(len(values)), type=arrow_type
    )  # a vector of one is a scalar column, as LeRobot stores it


def _write_tasks_parquet(path: Path, tasks: Mapping[str, int]) -> None:
    """meta/tasks.parquet as LeRobot writes it with pandas: a task_index column indexed by the task text."""
    table = pa.table(
        {"task_index": pa.array(list(tasks.values()), pa.int64()), "task": pa.array(list(tasks), pa.string())}
    )
    pandas_metadata = {
        "index_columns": ["task"],
        "column_indexes": [],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas_metadata).encode()}), path)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
