"""Datasets laid out as the `lerobot` library (0.4) writes them, built without it, for the reader's
conformance tests.

What this reproduces of lerobot 0.4's writer (`LeRobotDataset.save_episode` and its metadata):
- each episode's video is encoded on its own with PyAV (`add_stream(codec, fps, options={g, crf})`,
  frames given as RGB without timestamps, FFmpeg's own colour conversion), libx264 with its default
  B-frames (so composition offsets and an edit list) or libsvtav1;
- v3.0: episodes are appended to the current data parquet file (one row group each) and concatenated
  into the current mp4 per camera with FFmpeg's concat demuxer and a stream copy into a temporary
  file that is moved into place, which is why those files end up with mode 0600; an episode is found
  by `from_timestamp`/`to_timestamp`, the running sum of the episode files' durations. A new file
  starts when a size limit is reached (here: every `episodes_per_*_file` episodes), and the file index
  rolls over into the next chunk after `chunks_size` files;
- v3.0: episode metadata is buffered and flushed every `META_BUFFER` episodes as a row group of the
  current meta/episodes file, with the episode's statistics as `stats/<feature>/<stat>` columns;
- v2.1 (the layout of lerobot 0.3 and earlier): one parquet file and one mp4 per episode and camera,
  in chunks of `chunks_size` episodes;
- statistics per episode for every numeric feature (min, max, mean, std, count, quantiles q01 to q99;
  cameras per channel in [0, 1], shaped [3, 1, 1]), aggregated by count-weighted means into
  meta/stats.json;
- tasks as a pandas DataFrame indexed by the task text (meta/tasks.parquet), or tasks.jsonl in v2.1;
- `names: null` on every index feature, and on vectors when the recording named nothing.

`release="0.6"`: what lerobot 0.6.1 (the newest release, tag v0.6.1, read in
src/lerobot/datasets/dataset_writer.py, dataset_metadata.py, feature_utils.py, io_utils.py, utils.py
and video_utils.py) writes differently from 0.4: meta/info.json in the field order of its
`DatasetInfo` dataclass; a camera's `info` block with the encoder's settings as `video.<field>`
(g, crf, preset, fast_decode, video_backend, extra_options) and `is_depth_map` in place of
`video.is_depth_map`; meta/tasks.parquet indexed by a pandas index named "task". Data files are
still one row group per episode with vectors as fixed-size lists, episodes still concatenated into
shared mp4s. (Its 12-bit depth encoding is not reproduced: depth cameras are 0.4's.)

`converted=True`: a v2.1 dataset as above, then rewritten to v3.0 as lerobot 0.6.1's
src/lerobot/scripts/convert_dataset_v21_to_v30.py does (see `convert_v21_to_v30`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import av
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration for every file otherwise; errors only
META_BUFFER = 10  # lerobot's default metadata_buffer_size
CONVERTER_CHUNKS_SIZE = 1000  # lerobot's DEFAULT_CHUNK_SIZE
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
TASKS = ("pick up the red cube", "push the block to the left", "open the drawer")
STATE_DIM, ACTION_DIM = 6, 4


@dataclass(frozen=True)
class Camera:
    key: str
    height: int
    width: int
    depth: bool = False  # a depth map, stored as a grey 8-bit video with video.is_depth_map: true


@dataclass(frozen=True)
class Variant:
    name: str
    version: str  # "v2.1" or "v3.0"
    codec: str  # "libx264" or "libsvtav1"
    cameras: tuple[Camera, ...]
    lengths: tuple[int, ...]  # frames per episode
    names: str = "list"  # how state and action name their dimensions: "list", "null" or "dict"
    chunks_size: int = 1000
    episodes_per_data_file: int = 1000  # v3.0: stands in for data_files_size_in_mb
    episodes_per_video_file: int = 1000  # v3.0: stands in for video_files_size_in_mb
    episodes_per_meta_file: int = 1000  # v3.0: stands in for the episodes metadata's size limit
    gop: int = 2  # lerobot's default; libx264 uses B-frames only in longer GOPs
    crf: int = 30
    fps: int = 10
    missing_stats: tuple[str, ...] = ()  # features left out of meta/stats.json
    release: str = "0.4"  # the lerobot release whose writer is reproduced: "0.4" or "0.6"
    converted: bool = False  # written as v2.1, then converted to v3.0 by lerobot's converter
    data_file_mb: float = 100.0  # the converter's size limits (its defaults)
    video_file_mb: float = 200.0


def frame(camera: Camera, episode: int, t: int) -> np.ndarray:
    """The uint8 RGB image a camera records: smooth (codecs keep it well) and different enough from
    frame to frame that a frame read at the wrong time is told apart."""
    y, x = np.mgrid[0 : camera.height, 0 : camera.width].astype(np.float64)
    phase = 2 * np.pi * (x / camera.width + t / 7 + episode / 5)
    if camera.depth:
        depth = 90 + 70 * np.sin(phase) * (0.5 + y / camera.height / 2)
        return np.repeat(depth[..., None], 3, axis=-1).round().astype(np.uint8)
    channels = [128 + 90 * np.sin(phase), 128 + 90 * np.cos(phase + y / camera.height), 60 + 120 * y / camera.height]
    return np.stack(channels, axis=-1).round().clip(0, 255).astype(np.uint8)


def vectors(episode: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The state and action an episode records (float32, any values: they must come back exactly)."""
    rng = np.random.default_rng(1000 + episode)
    return rng.normal(size=(length, STATE_DIM)).astype(np.float32), rng.normal(size=(length, ACTION_DIM)).astype(
        np.float32
    ) * 3


def task_of(episode: int) -> str:
    return TASKS[episode % len(TASKS)]


def write(variant: Variant, root: Path) -> Path:
    """Write `variant` at `root` as lerobot 0.4 (or 0.6) would; returns root."""
    if variant.converted:
        source = Path(tempfile.mkdtemp(prefix="lerobot-v21-")) / root.name
        write(replace(variant, version="v2.1", converted=False), source)
        convert_v21_to_v30(source, root, variant.data_file_mb, variant.video_file_mb)
        shutil.rmtree(source.parent)
        return root
    root.mkdir(parents=True)
    writer = _Writer(variant, root)
    for episode, length in enumerate(variant.lengths):
        writer.save_episode(episode, length)
    writer.finalize()
    return root


# ---- internals -------------------------------------------------------------------------------------


def _names(variant: Variant, prefix: str, dim: int) -> Any:
    names = [f"{prefix}_{i}" for i in range(dim)]
    return {"list": names, "null": None, "dict": {"motors": names}}[variant.names]


def _features(variant: Variant) -> dict[str, Any]:
    features: dict[str, Any] = {}
    for camera in variant.cameras:
        features[camera.key] = {
            "dtype": "video",
            "shape": [camera.height, camera.width, 1 if camera.depth else 3],
            "names": ["height", "width", "channels"],
            "info": None,  # filled from the first episode's video, as lerobot does
        }
    features["observation.state"] = {
        "dtype": "float32",
        "shape": [STATE_DIM],
        "names": _names(variant, "joint", STATE_DIM),
    }
    features["action"] = {"dtype": "float32", "shape": [ACTION_DIM], "names": _names(variant, "motor", ACTION_DIM)}
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for key in ("frame_index", "episode_index", "index", "task_index"):
        features[key] = {"dtype": "int64", "shape": [1], "names": None}
    return features


def _arrow_type(feature: dict[str, Any]) -> pa.DataType:
    scalar = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
    return scalar if feature["shape"] == [1] else pa.list_(scalar, feature["shape"][0])


def _stats(values: np.ndarray, image: bool) -> dict[str, np.ndarray]:
    """Statistics of one episode's feature as lerobot keeps them (images per channel, in [0, 1])."""
    if image:  # [T, H, W, 3] -> per channel, shaped [3, 1, 1]
        flat = values.reshape(-1, 3).astype(np.float64) / 255.0
        shape = (3, 1, 1)
    else:
        flat = values.reshape(len(values), -1).astype(np.float64)
        shape = (flat.shape[1],)
    stats = {
        "min": flat.min(axis=0),
        "max": flat.max(axis=0),
        "mean": flat.mean(axis=0),
        "std": flat.std(axis=0),
        **{f"q{round(q * 100):02d}": np.quantile(flat, q, axis=0) for q in QUANTILES},
    }
    stats = {name: value.reshape(shape) for name, value in stats.items()}
    stats["count"] = np.array([len(values)])
    return stats


def _aggregate(per_episode: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """Count-weighted means of means, variances and quantiles; min of mins, max of maxes."""
    out = {}
    for key in per_episode[0]:
        parts = [stats[key] for stats in per_episode]
        counts = np.array([p["count"][0] for p in parts], dtype=np.float64)
        weights = counts.reshape(-1, *([1] * parts[0]["mean"].ndim)) / counts.sum()
        mean = (np.stack([p["mean"] for p in parts]) * weights).sum(axis=0)
        variance = (
            (np.stack([p["std"] for p in parts]) ** 2 + (np.stack([p["mean"] for p in parts]) - mean) ** 2) * weights
        ).sum(axis=0)
        agg = {
            "min": np.min([p["min"] for p in parts], axis=0),
            "max": np.max([p["max"] for p in parts], axis=0),
            "mean": mean,
            "std": np.sqrt(variance),
            "count": np.array([int(counts.sum())]),
        }
        for name in (n for n in parts[0] if n.startswith("q")):
            agg[name] = (np.stack([p[name] for p in parts]) * weights).sum(axis=0)
        out[key] = agg
    return out


def _json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value.tolist() if isinstance(value, np.ndarray) else value


def _encode_episode(variant: Variant, camera: Camera, episode: int, length: int, directory: Path) -> Path:
    """One episode's mp4, encoded as lerobot's encode_video_frames does."""
    path = directory / f"{camera.key}-episode-{episode:06d}.mp4"
    options = {"g": str(variant.gop), "crf": str(variant.crf)}
    if variant.codec == "libsvtav1":
        options["preset"] = "12"
    with av.open(str(path), "w") as output:
        stream = output.add_stream(variant.codec, variant.fps, options=options)
        stream.pix_fmt, stream.width, stream.height = "yuv420p", camera.width, camera.height
        for t in range(length):
            output.mux(stream.encode(av.VideoFrame.from_ndarray(frame(camera, episode, t), format="rgb24")))
        output.mux(stream.encode())
    return path


def _duration_s(path: Path) -> float:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.duration is not None:
            return float(stream.duration * stream.time_base)
        return float(container.duration / av.time_base)


def _concatenate(parts: list[Path], target: Path) -> None:
    """Join `parts` by stream copy through FFmpeg's concat demuxer into a temporary file moved to
    `target` (as lerobot does, which leaves the file with the temporary file's mode 0600)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ffconcat", delete=False) as listing:
        listing.write("ffconcat version 1.0\n" + "".join(f"file '{p.resolve()}'\n" for p in parts))
    with tempfile.NamedTemporaryFile(suffix=".mp4", delete=False) as temporary:
        output_path = temporary.name
    source = av.open(listing.name, format="concat", options={"safe": "0"})
    output = av.open(output_path, "w", options={"movflags": "faststart"})
    copied = {}
    for stream in source.streams.video:
        copied[stream.index] = output.add_stream_from_template(template=stream, opaque=True)
        copied[stream.index].time_base = stream.time_base
    for packet in source.demux():
        if packet.stream.index in copied and packet.dts is not None:
            packet.stream = copied[packet.stream.index]
            output.mux(packet)
    source.close()
    output.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(output_path, target)
    Path(listing.name).unlink()


def lines(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    return (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)


class _Writer:
    def __init__(self, variant: Variant, root: Path):
        self.variant, self.root = variant, root
        self.features = _features(variant)
        self.schema = pa.schema(
            [pa.field(k, _arrow_type(f)) for k, f in self.features.items() if f["dtype"] != "video"],
            metadata={
                "huggingface": json.dumps({"info": {"features": {k: {"_type": "Value"} for k in self.features}}})
            },
        )
        self.tasks: dict[str, int] = {}
        self.episode_stats: list[dict[str, dict[str, np.ndarray]]] = []
        self.episode_rows: list[dict[str, Any]] = []
        self.frames = 0
        self.scratch = Path(tempfile.mkdtemp(prefix="episode-videos-"))
        # v3.0: the open data and meta writers and the current video file per camera
        self.data_writer: pq.ParquetWriter | None = None
        self.data_file = (0, 0)
        self.videos: dict[str, tuple[int, int, float]] = {}  # camera -> (chunk, file, duration so far)
        self.meta_writer: pq.ParquetWriter | None = None
        self.meta_file = (0, 0)
        self.meta_buffer: list[dict[str, Any]] = []
        self.meta_in_file = 0

    def save_episode(self, episode: int, length: int) -> None:
        v = self.variant
        task = task_of(episode)
        self.tasks.setdefault(task, len(self.tasks))
        state, action = vectors(episode, length)
        columns = {
            "observation.state": state,
            "action": action,
            "timestamp": (np.arange(length) / v.fps).astype(np.float32),
            "frame_index": np.arange(length),
            "episode_index": np.full(length, episode),
            "index": np.arange(self.frames, self.frames + length),
            "task_index": np.full(length, self.tasks[task]),
        }
        stats = {key: _stats(value, image=False) for key, value in columns.items()}
        for camera in v.cameras:
            stats[camera.key] = _stats(np.stack([frame(camera, episode, t) for t in range(length)]), image=True)
        table = pa.table(
            {k: pa.array(list(c) if c.ndim > 1 else c, type=self.schema.field(k).type) for k, c in columns.items()},
            schema=self.schema,
        )
        row: dict[str, Any] = {"episode_index": episode, "tasks": [task], "length": length}
        if v.version == "v3.0":
            row.update(self._append_data(episode, table))
            for camera in v.cameras:
                row.update(self._append_video(camera, episode, length))
        else:
            self._write_v21_episode(episode, length, table)
        self.episode_stats.append(stats)
        self.episode_rows.append(row)
        self.frames += length
        if v.version == "v3.0":
            self._buffer_meta({**row, **{f"stats/{k}/{n}": value for k, s in stats.items() for n, value in s.items()}})

    # -- v3.0 ---------------------------------------------------------------------------------------

    def _append_data(self, episode: int, table: pa.Table) -> dict[str, Any]:
        v = self.variant
        if episode and episode % v.episodes_per_data_file == 0:
            self.data_writer.close()
            self.data_writer, self.data_file = None, _next_file(*self.data_file, v.chunks_size)
        if self.data_writer is None:
            path = self.root / "data" / f"chunk-{self.data_file[0]:03d}" / f"file-{self.data_file[1]:03d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.data_writer = pq.ParquetWriter(path, schema=self.schema, compression="snappy", use_dictionary=True)
        self.data_writer.write_table(table)
        return {
            "data/chunk_index": self.data_file[0],
            "data/file_index": self.data_file[1],
            "dataset_from_index": self.frames,
            "dataset_to_index": self.frames + table.num_rows,
        }

    def _append_video(self, camera: Camera, episode: int, length: int) -> dict[str, Any]:
        v = self.variant
        encoded = _encode_episode(v, camera, episode, length, self.scratch)
        duration = _duration_s(encoded)
        chunk, file, start = self.videos.get(camera.key, (0, 0, 0.0))
        new_file = episode == 0 or episode % v.episodes_per_video_file == 0
        if new_file and episode:
            (chunk, file), start = _next_file(chunk, file, v.chunks_size), 0.0
        path = self.root / "videos" / camera.key / f"chunk-{chunk:03d}" / f"file-{file:03d}.mp4"
        if new_file:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(encoded, path)
        else:
            _concatenate([path, encoded], path)
            encoded.unlink()
        if episode == 0:
            self._video_info(camera, path)
        self.videos[camera.key] = (chunk, file, start + duration)
        prefix = f"videos/{camera.key}"
        return {
            f"{prefix}/chunk_index": chunk,
            f"{prefix}/file_index": file,
            f"{prefix}/from_timestamp": start,
            f"{prefix}/to_timestamp": start + duration,
        }

    def _buffer_meta(self, row: dict[str, Any]) -> None:
        v = self.variant
        if self.meta_in_file == v.episodes_per_meta_file:  # the size limit: flush and start the next file
            self._flush_meta()
            self.meta_writer.close()
            self.meta_writer, self.meta_file, self.meta_in_file = None, _next_file(*self.meta_file, v.chunks_size), 0
        row = {**row, "meta/episodes/chunk_index": self.meta_file[0], "meta/episodes/file_index": self.meta_file[1]}
        self.meta_buffer.append({k: _json(value) for k, value in row.items()})
        self.meta_in_file += 1
        if len(self.meta_buffer) >= META_BUFFER:
            self._flush_meta()

    def _flush_meta(self) -> None:
        if not self.meta_buffer:
            return
        table = pa.Table.from_pylist(self.meta_buffer)
        if self.meta_writer is None:
            path = (
                self.root
                / "meta"
                / "episodes"
                / f"chunk-{self.meta_file[0]:03d}"
                / f"file-{self.meta_file[1]:03d}.parquet"
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            self.meta_writer = pq.ParquetWriter(path, schema=table.schema, compression="snappy", use_dictionary=True)
        self.meta_writer.write_table(table)
        self.meta_buffer.clear()

    # -- v2.1 ---------------------------------------------------------------------------------------

    def _write_v21_episode(self, episode: int, length: int, table: pa.Table) -> None:
        chunk = episode // self.variant.chunks_size
        path = self.root / "data" / f"chunk-{chunk:03d}" / f"episode_{episode:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        for camera in self.variant.cameras:
            target = self.root / "videos" / f"chunk-{chunk:03d}" / camera.key / f"episode_{episode:06d}.mp4"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(_encode_episode(self.variant, camera, episode, length, self.scratch), target)
            if episode == 0:
                self._video_info(camera, target)

    # -- both ---------------------------------------------------------------------------------------

    def _video_info(self, camera: Camera, path: Path) -> None:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            info = {
                "video.height": stream.height,
                "video.width": stream.width,
                "video.codec": stream.codec.canonical_name,
                "video.pix_fmt": stream.pix_fmt,
                "video.is_depth_map": camera.depth,
                "video.fps": int(stream.base_rate),
                "video.channels": 3,
                "has_audio": False,
            }
        if self.variant.release == "0.6":  # the encoder's settings, and the depth marker renamed
            del info["video.is_depth_map"]
            v = self.variant
            preset = 12 if v.codec == "libsvtav1" else None
            info.update({"video.g": v.gop, "video.crf": v.crf, "video.preset": preset, "video.fast_decode": 0})
            info.update({"video.video_backend": "pyav", "video.extra_options": {}, "is_depth_map": camera.depth})
        self.features[camera.key]["info"] = info

    def finalize(self) -> None:
        v = self.variant
        meta = self.root / "meta"
        meta.mkdir(exist_ok=True)
        stats = _aggregate(self.episode_stats)
        for key in v.missing_stats:
            del stats[key]
        (meta / "stats.json").write_text(json.dumps(_json(stats), indent=4))
        info: dict[str, Any] = {
            "codebase_version": v.version,
            "robot_type": "so100_follower",
            "total_episodes": len(v.lengths),
            "total_frames": self.frames,
            "total_tasks": len(self.tasks),
            "chunks_size": v.chunks_size,
            "fps": v.fps,
            "splits": {"train": f"0:{len(v.lengths)}"},
        }
        if v.version == "v3.0":
            self.data_writer.close()
            self._flush_meta()
            self.meta_writer.close()
            index = pd.Index(list(self.tasks), name="task" if v.release == "0.6" else None)
            pd.DataFrame({"task_index": list(self.tasks.values())}, index=index).to_parquet(meta / "tasks.parquet")
            info.update(
                data_files_size_in_mb=100,
                video_files_size_in_mb=200,
                data_path="data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                video_path="videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            )
        else:
            (meta / "tasks.jsonl").write_text(lines({"task_index": i, "task": t} for t, i in self.tasks.items()))
            (meta / "episodes.jsonl").write_text(lines(self.episode_rows))
            (meta / "episodes_stats.jsonl").write_text(
                lines({"episode_index": e, "stats": _json(s)} for e, s in enumerate(self.episode_stats))
            )
            info.update(
                total_chunks=(len(v.lengths) - 1) // v.chunks_size + 1,
                total_videos=len(v.lengths) * len(v.cameras),
                data_path="data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                video_path="videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            )
        info["features"] = self.features
        if v.release == "0.6":
            info = _dataset_info_order(info)
        (meta / "info.json").write_text(json.dumps(info, indent=4))
        shutil.rmtree(self.scratch)


# The fields of lerobot 0.6's DatasetInfo, in order: info.json is that dataclass written out, and
# keys it does not know (v2.1's total_chunks, total_videos) are dropped when it is built.
DATASET_INFO_FIELDS = (
    "codebase_version",
    "fps",
    "features",
    "total_episodes",
    "total_frames",
    "total_tasks",
    "chunks_size",
    "data_files_size_in_mb",
    "video_files_size_in_mb",
    "data_path",
    "video_path",
    "robot_type",
    "splits",
)


def _dataset_info_order(info: dict[str, Any]) -> dict[str, Any]:
    defaults = {"data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "chunks_size": 1000, "splits": {}}
    return {key: info.get(key, defaults.get(key)) for key in DATASET_INFO_FIELDS}


# ---- lerobot's v2.1 -> v3.0 converter --------------------------------------------------------------


def convert_v21_to_v30(source: Path, target: Path, data_file_mb: float, video_file_mb: float) -> None:
    """Rewrite the v2.1 dataset at `source` to v3.0 at `target`, step for step as lerobot 0.6.1's
    convert_dataset_v21_to_v30 (convert_info, convert_tasks, convert_data, convert_videos,
    convert_episodes_metadata):
    - data: the episode files in path order are read with pandas and concatenated into one parquet
      file per group, a group closing before the episode that would bring it to `data_file_mb`;
      pandas writes the vectors back as variable-size `list<float>` and one row group per file;
    - videos: per camera (cameras sorted), the episode files grouped the same way by `video_file_mb`
      and joined by one concat-demuxer stream copy per file; from/to_timestamp are the running sums
      of the episode files' durations, restarting at each file;
    - meta/episodes: one file, chunk 0 file 0, a row per episode holding the data and video
      locations, the v2.1 episode row and its statistics flattened to `stats/<feature>/<stat>`;
    - meta/stats.json aggregated from episodes_stats.jsonl; meta/tasks.parquet indexed by "task";
    - meta/info.json: codebase_version v3.0, the size limits and v3.0 path templates, `fps` added to
      every non-video feature, written through DatasetInfo (its fields, in its order)."""
    meta = target / "meta"
    meta.mkdir(parents=True)
    info = json.loads((source / "meta" / "info.json").read_text())
    info["codebase_version"] = "v3.0"
    info.update(data_files_size_in_mb=data_file_mb, video_files_size_in_mb=video_file_mb, fps=int(info["fps"]))
    info["data_path"] = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    for feature in info["features"].values():
        if feature["dtype"] != "video":
            feature["fps"] = info["fps"]
    (meta / "info.json").write_text(json.dumps(_dataset_info_order(info), indent=4))

    tasks = [json.loads(line) for line in (source / "meta" / "tasks.jsonl").read_text().splitlines()]
    tasks.sort(key=lambda row: row["task_index"])
    index = pd.Index([row["task"] for row in tasks], name="task")
    pd.DataFrame({"task_index": [row["task_index"] for row in tasks]}, index=index).to_parquet(meta / "tasks.parquet")

    # The converter numbers files with lerobot's default chunk size, whatever info.json's chunks_size says.
    rows = _convert_data(source, target, data_file_mb, CONVERTER_CHUNKS_SIZE)
    cameras = sorted(key for key, feature in info["features"].items() if feature["dtype"] == "video")
    for camera in cameras:
        for row, video in zip(rows, _convert_videos(source, target, camera, video_file_mb, CONVERTER_CHUNKS_SIZE)):
            row.update(video)
    legacy = [json.loads(line) for line in (source / "meta" / "episodes.jsonl").read_text().splitlines()]
    stats = [json.loads(line)["stats"] for line in (source / "meta" / "episodes_stats.jsonl").read_text().splitlines()]
    episodes = []
    for row, episode, episode_stats in zip(rows, legacy, stats):
        flat = {f"stats/{key}/{name}": value for key, values in episode_stats.items() for name, value in values.items()}
        episodes.append({**row, **episode, **flat, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
    path = target / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(episodes), path)
    as_arrays = [{k: {n: np.asarray(v) for n, v in s.items()} for k, s in episode.items()} for episode in stats]
    (meta / "stats.json").write_text(json.dumps(_json(_aggregate(as_arrays)), indent=4))


def _size_mb(path: Path) -> float:
    return path.stat().st_size / 1024**2


def _convert_data(source: Path, target: Path, limit_mb: float, chunks_size: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    group: list[Path] = []
    chunk, file, size, frames = 0, 0, 0.0, 0

    def flush() -> None:
        path = target / "data" / f"chunk-{chunk:03d}" / f"file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.concat([pd.read_parquet(p) for p in group], ignore_index=True).to_parquet(path, index=False)

    for episode, path in enumerate(sorted((source / "data").glob("*/*.parquet"))):
        episode_mb, episode_frames = _size_mb(path), pq.ParquetFile(path).metadata.num_rows
        if size + episode_mb >= limit_mb and group:
            flush()
            (chunk, file), size, group = _next_file(chunk, file, chunks_size), 0.0, []
        rows.append(
            {
                "episode_index": episode,
                "data/chunk_index": chunk,
                "data/file_index": file,
                "dataset_from_index": frames,
                "dataset_to_index": frames + episode_frames,
            }
        )
        size, frames = size + episode_mb, frames + episode_frames
        group.append(path)
    flush()
    return rows


def _convert_videos(source: Path, target: Path, camera: str, limit_mb: float, chunks_size: int) -> list[dict]:
    rows: list[dict[str, Any]] = []
    group: list[Path] = []
    chunk, file, size, start = 0, 0, 0.0, 0.0
    prefix = f"videos/{camera}"

    def flush() -> None:
        _concatenate(group, target / "videos" / camera / f"chunk-{chunk:03d}" / f"file-{file:03d}.mp4")

    for path in sorted((source / "videos").glob(f"*/{camera}/*.mp4")):
        episode_mb, duration = _size_mb(path), _duration_s(path)
        if size + episode_mb >= limit_mb and group:
            flush()
            (chunk, file), size, start, group = _next_file(chunk, file, chunks_size), 0.0, 0.0, []
        rows.append(
            {
                f"{prefix}/chunk_index": chunk,
                f"{prefix}/file_index": file,
                f"{prefix}/from_timestamp": start,
                f"{prefix}/to_timestamp": start + duration,
            }
        )
        size, start = size + episode_mb, start + duration
        group.append(path)
    flush()
    return rows
