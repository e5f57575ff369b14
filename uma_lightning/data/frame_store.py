"""The decoded-frame store: every frame of a dataset's videos, decoded once (and optionally resized),
in memory-mappable files on local disk, for when decoding cannot keep up with training.

Layout: one raw uint8 file [T, H, W, 3] per source video file, and manifest.json, written last,
which ties the store to its source: the dataset's root, the image size, and per video file its
size and hash (a remote file's size and ETag), the shard's size and hashes and the frames'
timestamps. A store is written into `<dir>.partial` and renamed into place, so it exists complete
or not at all.

On load, a store whose source changed (a video's size or hash differs) is stale: the loader logs
which file and decodes the videos instead. A corrupt store (unreadable manifest, a shard missing,
of the wrong size, or whose first and last MiB do not match their hash) is refused with an error
naming the file; `uma data cache ROOT --rebuild` writes it again. `--verify` hashes every shard whole.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np

from uma_lightning.data.lerobot import DatasetError, LeRobotMetadata
from uma_lightning.data.video import VideoError, to_rgb
from uma_lightning.progress import Progress

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STORE_FORMAT = 1
SAMPLE_BYTES = 2**20  # the head and tail of each shard hashed at every load


class FrameStoreError(DatasetError):
    """A store that cannot be used: corrupt, of another dataset, or too large for its bound."""


def default_store_dir(metadata: LeRobotMetadata, size: tuple[int, int], cache_dir: Path) -> Path:
    """Where `uma data cache` writes, and the loader looks, for this dataset at this image size."""
    root = str(metadata.root).rstrip("/")
    tag = hashlib.blake2b(root.encode(), digest_size=6).hexdigest()
    return cache_dir / "frames" / f"{Path(root).name}-{tag}-{size[0]}x{size[1]}"


def _hash_file(path: Path, start: int = 0, length: int | None = None) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        handle.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            block = handle.read(8 * 2**20 if remaining is None else min(8 * 2**20, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def _sample_hash(path: Path, size: int) -> str:
    """Hash of the first and last MiB: cheap enough for every load, and catches truncation and torn writes."""
    head = _hash_file(path, 0, SAMPLE_BYTES)
    return head + _hash_file(path, max(0, size - SAMPLE_BYTES), SAMPLE_BYTES)


def source_identity(metadata: LeRobotMetadata, relative: str) -> dict[str, Any]:
    """What ties a shard to its video file: local files by size and content hash; remote ones by the
    size and ETag the object store reports, so checking them downloads nothing."""
    storage = metadata.storage
    if storage.remote:
        info = storage.fs.info(storage.url(relative))
        return {"size": int(info["size"]), "etag": str(info.get("ETag") or info.get("etag") or info.get("md5") or "")}
    path = storage.path(relative)
    return {"size": path.stat().st_size, "blake2b": _hash_file(path)}


def store_files(metadata: LeRobotMetadata, cameras: tuple[str, ...]) -> list[str]:
    """The video files (relative paths) of the given cameras, each once, in episode order."""
    seen: dict[str, None] = {}
    for episode in metadata.episodes:
        for camera in cameras:
            seen.setdefault(episode.videos[camera][0], None)
    return list(seen)


@dataclass
class _Shard:
    path: Path
    times: list[float]  # seconds, increasing
    shape: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        span = self.times[-1] - self.times[0]
        self._rate = (len(self.times) - 1) / span if span > 0 else 0.0

    def indices(self, timestamps: np.ndarray, tolerance_s: float) -> list[int]:
        """The frames at `timestamps`: each first guessed from the frame rate, else searched.
        Python scalars rather than numpy calls: a sample asks for a few frames, and per-call
        overhead, not the copy, would otherwise dominate."""
        times, first_time, rate, last = self.times, self.times[0], self._rate, len(self.times) - 1
        found = []
        for time in timestamps.tolist():
            k = int((time - first_time) * rate + 0.5)
            if not 0 <= k <= last or abs(times[k] - time) > tolerance_s:
                k = min(bisect.bisect_left(times, time - tolerance_s), last)
                if abs(times[k] - time) > tolerance_s:
                    raise VideoError(
                        f"{self.path}: no stored frame at timestamp {time:.6f}s (tolerance {tolerance_s}s)"
                    )
            found.append(k)
        return found


class FrameStore:
    """A valid store, opened: `frames(relative, timestamps)` reads frames through a read-only memory map."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.size = tuple(manifest["image_size"])
        self.cameras = tuple(manifest["cameras"])
        self._shards = {
            relative: _Shard(directory / entry["shard"], [float(t) for t in entry["times"]], tuple(entry["shape"]))
            for relative, entry in manifest["files"].items()
        }
        self._maps: dict[str, np.memmap] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # each process maps the files itself

    def __contains__(self, relative: str) -> bool:
        return relative in self._shards

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shard.shape)) for shard in self._shards.values())

    def frames(
        self, relative: str, timestamps: np.ndarray, tolerance_s: float, out: np.ndarray | None = None
    ) -> np.ndarray:
        """uint8 [N, H, W, 3] at `timestamps` (seconds in the file), written into `out` when it is given;
        a time without a stored frame is an error."""
        shard = self._shards[relative]
        index = shard.indices(np.asarray(timestamps, dtype=np.float64).reshape(-1), tolerance_s)
        frames = self._maps.get(relative)
        if frames is None:
            frames = self._maps[relative] = _map(shard.path, shard.shape)
        first = index[0]
        if index[-1] - first == len(index) - 1 and index == list(range(first, first + len(index))):
            window = frames[first : first + len(index)]  # a history window: one contiguous copy
            if out is None:
                return window.copy()  # the batch owns its frames
        else:
            window = frames[index]  # fancy indexing copies
            if out is None:
                return window
        out[...] = window
        return out


def _map(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only memory map of a shard, asking for huge pages: where the filesystem caches files in
    large folios (ext4 and XFS on recent kernels), a shard read through it is then cached and mapped
    in 2 MiB pages, and copying frames out of it misses the TLB as rarely as copying from process memory."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapped, dtype=np.uint8).reshape(shape)


def open_store(directory: Path, metadata: LeRobotMetadata) -> FrameStore | None:
    """The store at `directory` if it is valid for `metadata`'s dataset; None if it is absent or stale
    (logged with the file that changed). Raises FrameStoreError if it is corrupt."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files, size, cameras = manifest["files"], manifest["image_size"], manifest["cameras"]
        if manifest.get("format") != STORE_FORMAT or not isinstance(files, dict) or len(size) != 2:
            raise ValueError("unknown format")
        del cameras
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise FrameStoreError(
            f"frame store {manifest_path} is corrupt ({error}); rebuild it with `uma data cache {metadata.root} --rebuild`"
        ) from error
    for entry in files.values():
        shard = directory / entry["shard"]
        actual = shard.stat().st_size if shard.exists() else None
        if actual != entry["shard_size"] or _sample_hash(shard, actual) != entry["sample_hash"]:
            why = (
                "missing"
                if actual is None
                else f"{actual} bytes, expected {entry['shard_size']}"
                if actual != entry["shard_size"]
                else "its content changed"
            )
            raise FrameStoreError(
                f"frame store shard {shard} is corrupt ({why}); rebuild it with `uma data cache {metadata.root} --rebuild`"
            )
    stale = _stale_file(manifest, metadata)
    if stale:
        logger.warning(
            "frame store %s is stale, not used: %s; rebuild it with `uma data cache %s --rebuild`",
            directory,
            stale,
            metadata.root,
        )
        return None
    return FrameStore(directory, manifest)


def _stale_file(manifest: dict[str, Any], metadata: LeRobotMetadata) -> str | None:
    """Why the store no longer matches its source (naming the file), or None."""
    if manifest.get("source") != str(metadata.root):
        return f"it was built from {manifest.get('source')}, not {metadata.root}"
    wanted = set(store_files(metadata, tuple(manifest["cameras"])))
    if wanted != set(manifest["files"]):
        missing = sorted(wanted ^ set(manifest["files"]))
        return f"the dataset's video files differ from the store's (first: {missing[0]})"
    for relative, entry in manifest["files"].items():
        try:
            identity = source_identity(metadata, relative)
        except OSError as error:
            return f"{metadata.storage.url(relative)} cannot be read ({error})"
        if identity != entry["source"]:
            return f"{metadata.storage.url(relative)} changed ({identity} != {entry['source']})"
    return None


def build_store(
    metadata: LeRobotMetadata,
    directory: Path,
    size: tuple[int, int] | None = None,
    cameras: tuple[str, ...] | None = None,
    max_bytes: int = 100 * 2**30,
) -> FrameStore:
    """Decode every frame of the cameras' videos (at `size`, else each camera's stored size) into a new store at `directory`."""
    cameras = tuple(cameras or metadata.cameras)
    unknown = [c for c in cameras if c not in metadata.cameras]
    if unknown:
        raise FrameStoreError(f"{metadata.root}: no camera {unknown[0]!r}; cameras are {list(metadata.cameras)}")
    size = tuple(size) if size is not None else metadata.image_size
    frames = sum(episode.length for episode in metadata.episodes) * len(cameras)
    expected = frames * size[0] * size[1] * 3
    if expected > max_bytes:
        raise FrameStoreError(
            f"frame store {directory}: {frames} frames at {size[0]}x{size[1]} need {expected / 2**30:.1f} GiB, "
            f"over the bound of {max_bytes / 2**30:.1f} GiB (--max-gb); store fewer cameras or a smaller --image-size"
        )
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entries: dict[str, Any] = {}
    written = decoded = 0
    with Progress(frames, "frame store: frames", "frame", logger=logger) as progress:
        for k, relative in enumerate(store_files(metadata, cameras)):
            name = f"{k:06d}.u8"
            times, count = _decode_into(metadata.storage.path(relative), partial / name, size, progress, decoded)
            decoded += count
            written += count * size[0] * size[1] * 3
            if written > max_bytes:
                shutil.rmtree(partial, ignore_errors=True)
                raise FrameStoreError(
                    f"frame store {directory}: over the bound of {max_bytes / 2**30:.1f} GiB at {relative}"
                )
            shard_size = (partial / name).stat().st_size
            entries[relative] = {
                "shard": name,
                "shape": [count, size[0], size[1], 3],
                "times": times,
                "shard_size": shard_size,
                "sample_hash": _sample_hash(partial / name, shard_size),
                "blake2b": _hash_file(partial / name),
                "source": source_identity(metadata, relative),
            }
    manifest = {
        "format": STORE_FORMAT,
        "source": str(metadata.root),
        "image_size": list(size),
        "cameras": list(cameras),
        "files": entries,
    }
    (partial / MANIFEST).write_text(json.dumps(manifest) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(partial, directory)
    return FrameStore(directory, manifest)


def verify_store(directory: Path) -> None:
    """Hash every shard whole against the manifest; raises FrameStoreError naming the first that differs."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for entry in manifest["files"].values():
        if _hash_file(directory / entry["shard"]) != entry["blake2b"]:
            raise FrameStoreError(
                f"frame store shard {directory / entry['shard']} is corrupt (its hash differs from the manifest's)"
            )


def _decode_into(
    source: Path, target: Path, size: tuple[int, int], progress: Progress, decoded_before: int
) -> tuple[list[float], int]:
    """Decode every frame of `source` in order, appending RGB bytes to `target`; (timestamps, count).
    `progress` counts the frames, after the `decoded_before` of earlier files."""
    times: list[float] = []
    try:
        with av.open(str(source)) as container, open(target, "wb") as out:
            stream = container.streams.video[0]
            stream.thread_count = 1
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                out.write(to_rgb(frame, size).tobytes())
                times.append(float(frame.pts * frame.time_base))
                progress.update(decoded_before + len(times))
            out.flush()
            os.fsync(out.fileno())  # on disk before the manifest names it
            if hasattr(os, "posix_fadvise"):
                # Out of the page cache: read back through the store's huge-page mapping, it is
                # cached again in large folios (see _map) rather than in the 4 KiB pages written now.
                os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (av.FFmpegError, OSError) as error:
        raise VideoError(f"cannot decode video {source} for the frame store: {error}") from error
    return times, len(times)
