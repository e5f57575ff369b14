"""`uma data`: look at, summarise and convert LeRobot datasets.

    uma data info ROOT [--preview sheet.png] [--episode N]   what a dataset holds; a contact sheet of an episode
    uma data stats ROOT [--cameras] [--write]                 feature statistics by a fast pass over the parquet files
    uma data convert SRC DST --to v3.0                        rewrite a dataset in the v2.1 or v3.0 layout
    uma data cache ROOT [--image-size 224] [--cameras ...]     decode every frame once into the frame store the loader reads
    uma data generate --preset realistic [--codec av1] [--gop 2]  the benchmark dataset, generated once into the cache

ROOT may be a directory or an fsspec URL (remote files are cached under --cache-dir).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from uma_lightning.data.frame_store import FrameStoreError, build_store, default_store_dir, open_store, verify_store
from uma_lightning.data.generate import RealisticPreset, default_cache_dir, ensure_realistic
from uma_lightning.data.lerobot import (
    ACTION_KEY,
    ENV_STATE_KEY,
    INDEX_KEYS,
    STATE_KEY,
    VECTOR_KEYS,
    DatasetError,
    LeRobotMetadata,
)
from uma_lightning.data.source import Episode, SourceLayout, write_lerobot
from uma_lightning.data.stats import compute_stats, stats_to_json
from uma_lightning.data.storage import Storage, StorageError
from uma_lightning.data.video import CODECS, VideoError, VideoReader

logger = logging.getLogger("uma_lightning")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uma data", description="Look at, summarise and convert LeRobot datasets.")
    parser.add_argument("--cache-dir", default=None, help="local cache of remote files (default: <uma cache>/shards)")
    parser.add_argument("--storage-options", default="{}", help="fsspec options for remote roots, as JSON")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="what a dataset holds")
    info.add_argument("root")
    info.add_argument("--episode", type=int, default=0, help="episode of the preview")
    info.add_argument(
        "--preview", type=Path, help="write a contact sheet PNG of the episode: frames, instruction, actions"
    )
    stats = commands.add_parser("stats", help="feature statistics by a fast pass over the parquet files")
    stats.add_argument("root")
    stats.add_argument("--cameras", action="store_true", help="also decode video for image statistics")
    stats.add_argument("--frame-stride", type=int, default=1, help="with --cameras, use every N-th frame")
    stats.add_argument("--write", action="store_true", help="replace meta/stats.json (local datasets only)")
    convert = commands.add_parser("convert", help="rewrite a dataset in another LeRobot layout")
    convert.add_argument("source")
    convert.add_argument("target", type=Path)
    convert.add_argument("--to", choices=("v2.1", "v3.0"), required=True, dest="version")
    convert.add_argument(
        "--data-file-mb", type=float, default=100.0, help="v3.0: start a new parquet file past this size"
    )
    convert.add_argument("--video-file-mb", type=float, default=500.0, help="v3.0: start a new mp4 past this size")
    cache = commands.add_parser(
        "cache", help="decode every frame once into a memory-mappable frame store on local disk"
    )
    cache.add_argument("root")
    cache.add_argument(
        "--image-size", type=int, default=None, help="square side to store the frames at (default: as stored)"
    )
    cache.add_argument("--cameras", nargs="+", default=None, help="cameras to store (default: all)")
    cache.add_argument(
        "--out", type=Path, default=None, help="store directory (default: where the loader looks, under the uma cache)"
    )
    cache.add_argument("--max-gb", type=float, default=100.0, help="refuse to write a store larger than this")
    cache.add_argument(
        "--rebuild",
        action="store_true",
        help="write the store again even if it is valid (a corrupt one is always rewritten with this)",
    )
    cache.add_argument(
        "--verify", action="store_true", help="hash every shard of an existing store whole against its manifest"
    )
    generate = commands.add_parser(
        "generate", help="generate a benchmark dataset into the cache (once; later calls print its path)"
    )
    generate.add_argument("--preset", choices=("realistic",), required=True)
    generate.add_argument("--codec", choices=sorted(CODECS), default="av1")
    generate.add_argument("--gop", type=int, default=2, help="frames per group of pictures (LeRobot writes 2)")
    generate.add_argument("--episodes", type=int, default=RealisticPreset.n_episodes)
    generate.add_argument("--seconds", type=float, default=RealisticPreset.seconds, help="length of each episode")
    generate.add_argument("--version", choices=("v2.1", "v3.0"), default="v2.1")
    generate.add_argument(
        "--out", type=Path, default=None, help="directory the dataset goes under (default: the uma cache)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        preset = RealisticPreset(
            n_episodes=args.episodes, seconds=args.seconds, codec=args.codec, gop=args.gop, version=args.version
        )
        start = time.perf_counter()
        print(ensure_realistic(preset, args.out))
        logger.info("dataset ready in %.1fs", time.perf_counter() - start)
        return 0
    try:
        options = json.loads(args.storage_options)
        root = args.root if args.command != "convert" else args.source
        storage = Storage(root, args.cache_dir or default_cache_dir() / "shards", storage_options=options)
        metadata = LeRobotMetadata.load(storage)
        if args.command == "info":
            print_info(metadata)
            problems = check_readable(metadata)
            for problem in problems:
                print(f"uma data: error: {problem}", file=sys.stderr)
            if problems:
                return 2
            if args.preview:
                write_preview(metadata, args.episode, args.preview)
                print(f"preview of episode {args.episode}: {args.preview}")
        elif args.command == "stats":
            run_stats(metadata, args.cameras, args.frame_stride, args.write)
        elif args.command == "cache":
            run_cache(metadata, args)
        else:
            convert_dataset(metadata, args.target, args.version, args.data_file_mb, args.video_file_mb)
    except (DatasetError, VideoError, StorageError, FrameStoreError, FileExistsError, ValueError) as error:
        print(f"uma data: error: {error}", file=sys.stderr)
        return 2
    return 0


def print_info(metadata: LeRobotMetadata) -> None:
    lengths = [e.length for e in metadata.episodes]
    print(f"dataset   {metadata.root}")
    print(
        f"format    LeRobot {metadata.version}, robot {metadata.info.get('robot_type', 'unknown')}, {metadata.fps:g} fps"
    )
    print(
        f"episodes  {len(lengths)}, {sum(lengths)} frames (length {min(lengths)}..{max(lengths)}, mean {np.mean(lengths):.1f})"
    )
    print(f"files     {len(metadata.shards())} data file(s)")
    print(
        f"tasks     {len(metadata.tasks)}: "
        + "; ".join(metadata.tasks[:5])
        + (" ..." if len(metadata.tasks) > 5 else "")
    )
    for camera in metadata.cameras:
        shape = metadata.features[camera]["shape"]
        print(f"camera    {camera}: {shape[1]}x{shape[0]}")
    unused = metadata.unused_features()
    if unused:
        print(
            "unused    "
            + ", ".join(f"{key} ({dtype})" for key, dtype in unused.items())
            + ": training does not read these"
        )
    for key in (STATE_KEY, ACTION_KEY):
        stats = metadata.stats[key]
        names = metadata.feature_names(key)
        print(f"{key}:")
        for i, name in enumerate(names):
            print(
                f"  {name:>16}  mean {stats['mean'][i]:+.4f}  std {stats['std'][i]:.4f}  min {stats['min'][i]:+.4f}  max {stats['max'][i]:+.4f}"
            )


def check_readable(metadata: LeRobotMetadata, tolerance_s: float = 1e-4) -> list[str]:
    """What training would fail to read, one line per problem naming the file: the vector features'
    names and statistics, every episode's rows (columns, types, list lengths, indices, timestamps)
    and, per camera, the frames at its first and last timestamps (a truncated video loses its end)."""
    problems = []
    vectors = [key for key in VECTOR_KEYS if key in metadata.features]
    stats_file = metadata.storage.url("meta/stats.json")
    for key in vectors:
        try:
            dim = len(metadata.feature_names(key))
        except DatasetError as error:
            problems.append(str(error))
            continue
        for name, values in metadata.stats.get(key, {}).items():
            if name != "count" and np.size(values) != dim:
                problems.append(f"{stats_file}: {key}/{name} has {np.size(values)} values for {dim} dimensions")
    try:
        metadata.image_size  # noqa: B018 - raises when the dataset has no camera
    except DatasetError as error:
        problems.append(str(error))
    readers: dict[Path, VideoReader] = {}
    unopened: set[Path] = set()  # video files that do not open
    start = last = time.perf_counter()
    try:
        for position, episode in enumerate(metadata.episodes):
            try:
                data = metadata.read_episode(episode.index, tolerance_s=tolerance_s)
            except DatasetError as error:
                problems.append(str(error))
                continue
            ends = data.timestamp[[0, -1]].astype(np.float64)
            for camera in metadata.cameras:
                try:
                    path = metadata.video_path(episode.index, camera)
                    if path in unopened:
                        continue  # said once
                    if path not in readers:
                        unopened.add(path)
                        readers[path] = VideoReader(path)
                        unopened.remove(path)
                    readers[path].frames_at(episode.videos[camera][1] + ends, tolerance_s)
                except (DatasetError, VideoError) as error:
                    problems.append(f"episode {episode.index}: {error}")
            now = time.perf_counter()
            if now - last >= 5.0:
                logger.info("checked %d/%d episodes (%.1fs)", position + 1, len(metadata.episodes), now - start)
                last = now
    finally:
        for reader in readers.values():
            reader.close()
    if not problems:
        print(
            f"checked   every file the loader reads: {len(metadata.episodes)} episode(s), {len(readers)} video file(s)"
        )
    return problems


def write_preview(metadata: LeRobotMetadata, episode: int, path: Path, columns: int = 8) -> None:
    """A PNG: the episode's instruction, `columns` evenly spaced frames per camera, and its actions over time."""
    from PIL import Image, ImageDraw

    if not 0 <= episode < len(metadata.episodes):
        raise ValueError(f"episode {episode} outside 0..{len(metadata.episodes) - 1}")
    data = metadata.read_episode(episode)
    picks = np.linspace(0, len(data.timestamp) - 1, min(columns, len(data.timestamp))).round().astype(int)
    cell = 128
    rows = []
    for camera in metadata.cameras:
        reader = VideoReader(metadata.video_path(episode, camera))
        try:
            frames = reader.frames_at(
                metadata.episodes[episode].videos[camera][1] + data.timestamp[picks], tolerance_s=1e-4
            )
        finally:
            reader.close()
        rows.append([Image.fromarray(frame).resize((cell, cell), Image.NEAREST) for frame in frames])
    header, plot_height, margin = 28, 160, 8
    width = margin * 2 + len(picks) * cell
    height = header + len(rows) * (cell + 18) + plot_height + margin * 2
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((margin, 8), f"episode {episode}: {metadata.tasks[data.task_index[0]]}", fill="black")
    y = header
    for camera, images in zip(metadata.cameras, rows):
        draw.text((margin, y), camera, fill="gray")
        for k, image in enumerate(images):
            sheet.paste(image, (margin + k * cell, y + 14))
            draw.text((margin + k * cell + 2, y + 16), f"t={data.timestamp[picks[k]]:.1f}s", fill="white")
        y += cell + 18
    _plot(
        draw,
        data.action,
        (margin, y + margin, width - margin, y + plot_height),
        metadata.features[ACTION_KEY].get("names"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def _plot(draw, values: np.ndarray, box: tuple[int, int, int, int], names) -> None:
    left, top, right, bottom = box
    draw.rectangle(box, outline="lightgray")
    low, high = float(values.min()), float(values.max())
    span = high - low or 1.0
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    steps = max(len(values) - 1, 1)
    for d in range(values.shape[1]):
        points = [
            (left + (right - left) * t / steps, bottom - (bottom - top) * (float(v) - low) / span)
            for t, v in enumerate(values[:, d])
        ]
        colour = colours[d % len(colours)]
        draw.line(points, fill=colour, width=2)
        label = names[d] if names and d < len(names) else f"action {d}"
        draw.text((left + 4 + 90 * d, top + 2), label, fill=colour)


def run_cache(metadata: LeRobotMetadata, args: argparse.Namespace) -> None:
    size = (args.image_size, args.image_size) if args.image_size else metadata.image_size
    directory = args.out or default_store_dir(metadata, size, default_cache_dir())
    if args.verify:
        verify_store(directory)
        print(f"frame store {directory}: every shard matches its manifest")
        return
    if not args.rebuild:
        store = open_store(directory, metadata)  # a corrupt one raises, naming the file
        if (
            store is not None
            and store.size == size
            and (args.cameras is None or set(args.cameras) <= set(store.cameras))
        ):
            print(f"frame store {directory} is up to date")
            return
    start = time.perf_counter()
    store = build_store(
        metadata, directory, size, tuple(args.cameras) if args.cameras else None, int(args.max_gb * 2**30)
    )
    print(
        f"wrote frame store {directory}: {len(store.cameras)} camera(s), {store.nbytes / 2**30:.2f} GiB in {time.perf_counter() - start:.1f}s"
    )


def run_stats(metadata: LeRobotMetadata, cameras: bool, frame_stride: int, write: bool) -> None:
    start = time.perf_counter()
    stats = compute_stats(metadata, cameras=cameras, frame_stride=frame_stride)
    logger.info("statistics of %d episodes in %.1fs", len(metadata.episodes), time.perf_counter() - start)
    if write:
        if metadata.storage.remote:
            raise ValueError(f"{metadata.root}: --write needs a local dataset")
        merged = {**{k: v for k, v in metadata.stats.items()}, **stats}
        (Path(metadata.root) / "meta" / "stats.json").write_text(json.dumps(stats_to_json(merged), indent=2) + "\n")
        print(f"wrote {Path(metadata.root) / 'meta' / 'stats.json'}")
    else:
        print(json.dumps(stats_to_json(stats), indent=2))


class LeRobotEpisodes:
    """A LeRobot dataset's episodes, video decoded, as an episode source: what ``uma data convert`` rewrites."""

    def __init__(self, metadata: LeRobotMetadata):
        self.metadata = metadata
        vectors = [key for key in VECTOR_KEYS if key in metadata.features]
        names = {key: metadata.feature_names(key) for key in vectors}
        self.layout = SourceLayout(
            fps=metadata.fps,
            cameras=metadata.cameras,
            image_size=metadata.image_size,
            state_names=names[STATE_KEY],
            action_names=names[ACTION_KEY],
            environment_state_names=names.get(ENV_STATE_KEY, ()),
            robot_type=metadata.info.get("robot_type", "unknown"),
        )
        self.dropped = [
            k for k, f in metadata.features.items() if f["dtype"] != "video" and k not in (*vectors, *INDEX_KEYS)
        ]

    def __len__(self) -> int:
        return len(self.metadata.episodes)

    def __iter__(self) -> Iterator[Episode]:
        metadata = self.metadata
        readers: dict[Path, VideoReader] = {}  # v3.0 sources: one reader per file, decoding its episodes in order
        try:
            for episode in metadata.episodes:
                data = metadata.read_episode(episode.index)
                frames = {}
                for camera in metadata.cameras:
                    path = metadata.video_path(episode.index, camera)
                    if path not in readers:
                        for old in readers.values():
                            old.close()
                        readers = {path: VideoReader(path)}
                    times = episode.videos[camera][1] + data.timestamp.astype(np.float64)
                    frames[camera] = readers[path].frames_at(times, tolerance_s=1e-4)
                task = metadata.tasks[data.task_index[0]]
                yield Episode(frames, data.state, data.action, task, data.environment_state)
        finally:
            for reader in readers.values():
                reader.close()


def convert_dataset(
    metadata: LeRobotMetadata, target: Path, version: str, data_file_mb: float, video_file_mb: float
) -> None:
    """Rewrite every episode (low-dimensional columns as they are, video decoded and re-encoded)."""
    source = LeRobotEpisodes(metadata)
    if source.dropped:
        logger.warning(
            "convert: columns %s are not carried over (the writer knows cameras, state, action and environment state)",
            source.dropped,
        )
    write_lerobot(
        source,
        target,
        version=version,
        progress_label="convert: episodes",
        data_file_mb=data_file_mb,
        video_file_mb=video_file_mb,
    )
    print(f"wrote {target} (LeRobot {version})")
