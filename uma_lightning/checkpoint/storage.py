"""Tensors to and from a checkpoint directory with torch.distributed.checkpoint (DCP), loading only tensors.

DCP writes one ``__<rank>_<n>.distcp`` file per rank and a ``.metadata`` index; tensors saved sharded
(DTensors of FSDP2 or tensor parallelism) load into any other sharding or into plain tensors, which is
what makes a checkpoint loadable under another strategy or world size.

Saving checksums every file while its bytes are written (no second pass reading them back), starts
the disk writing each 64 MiB as soon as it is written, so the final fsync has little left to wait for,
and records where the time went (``SaveProfile``).

Loading never unpickles untrusted objects: DCP reads tensors with ``torch.load(weights_only=True)``,
its ``.metadata`` index (a pickle) is read by an unpickler that resolves only the classes DCP writes
there, and an entry stored as pickled bytes is refused instead of being loaded.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import warnings
import zlib
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from uma_lightning.checkpoint.manifest import CheckpointError

# A single process saves and loads without a process group on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Everything DCP puts in a .metadata pickle: its own dataclasses, torch sizes, dtypes and layouts, paths.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` index read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: not a valid checkpoint index: {err}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a valid checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is pickled bytes; only tensors are loaded"
        )


def tensor_metadata(directory: str | Path) -> dict[str, TensorStorageMetadata]:
    """Global shape and dtype of every tensor in the checkpoint, keyed like the saved dict."""
    entries = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    pickled = sorted(key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if pickled:
        raise CheckpointError(f"{directory}: entries {pickled[:3]} are pickled objects; only tensors are loaded")
    return entries


# Dirty pages are handed to the disk in steps of this many bytes while the file is still being written.
_WRITEBACK_STEP = 64 * 2**20
# torch.save's zip records carry their own CRC-32, computed in a second pass over every byte (2.5 GB/s
# on one core); the manifest's checksum already covers every byte, so our saves turn it off. The
# setting is process-wide: a lock keeps it off for as long as any of our saves runs and restores it after.
_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_before = True


class SaveProfile:
    """Seconds spent per phase of a save, summed over the threads that write; cheap enough to always keep."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    @contextmanager
    def timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)


class _ChecksummedFile:
    """A file being written: CRC-32 and size of the bytes as they pass, writeback started every
    ``_WRITEBACK_STEP`` bytes, and an fsync when closed. Only appends, as DCP's writer does."""

    def __init__(self, file, profile: SaveProfile):
        self._file = file
        self._profile = profile
        self.size = 0
        self.crc = 0
        self._written_back = 0
        self._seconds = {"checksum": 0.0, "write": 0.0}

    def write(self, data) -> int:
        view = memoryview(data)
        started = time.perf_counter()
        self.crc = zlib.crc32(view, self.crc)
        checksummed = time.perf_counter()
        self._file.write(view)
        self.size += view.nbytes
        if self.size - self._written_back >= _WRITEBACK_STEP:
            self._file.flush()
            # Starts writeback of the range's dirty pages without waiting for it (and drops them from
            # the cache once clean): the disk works while the rest is serialised.
            os.posix_fadvise(
                self._file.fileno(), self._written_back, self.size - self._written_back, os.POSIX_FADV_DONTNEED
            )
            self._written_back = self.size
        self._seconds["checksum"] += checksummed - started
        self._seconds["write"] += time.perf_counter() - checksummed
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if self._file.closed:
            return
        with self._profile.timed("fsync"):
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        for phase, seconds in self._seconds.items():
            self._profile.add(phase, seconds)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, with every written file checksummed as it is written and fsynced."""

    def __init__(self, profile: SaveProfile):
        super().__init__()
        self.profile = profile
        self.written: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, "wb", buffering=_WRITEBACK_STEP // 8) as file:
            stream = _ChecksummedFile(file, self.profile)
            yield stream
            stream.close()
        self.written[path.name] = {"bytes": stream.size, "crc32": f"{stream.crc:08x}"}


@contextmanager
def _without_zip_crc():
    global _zip_crc_users, _zip_crc_before
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                torch.serialization.set_crc32_options(_zip_crc_before)


def save_tensors(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    process_group: Optional[dist.ProcessGroup],
    profile: Optional[SaveProfile] = None,
) -> dict[str, dict]:
    """Write ``tensors`` (plain tensors or DTensors, on any device) to ``directory``, every file fsynced.
    Collective over ``process_group`` when distributed. Returns ``{name: {"bytes", "crc32"}}`` of the files
    this rank wrote (as ``manifest.describe_files`` would) and adds the time of each phase to ``profile``."""
    profile = profile if profile is not None else SaveProfile()
    storage = FileSystemWriter(directory, single_file_per_rank=True, sync_files=False)  # our files fsync on close
    storage.fs = _ChecksummingFileSystem(profile)
    with _plain_errors(directory, "writing"), _without_zip_crc(), profile.timed("tensors in all"):
        dcp.save(tensors, storage_writer=storage, process_group=process_group, no_dist=not _distributed())
    return storage.fs.written


def load_tensors(
    tensors: dict[str, torch.Tensor],
    directory: str | Path,
    process_group: Optional[dist.ProcessGroup],
    alone: bool = False,
) -> None:
    """Fill ``tensors`` in place from ``directory``, resharding as needed (each rank reads what it holds).
    Collective over ``process_group`` when distributed, unless ``alone``: this process reads by itself,
    as rank zero does after the other ranks have finished (a collective then waits for ranks that left).

    Raises CheckpointError naming the entries that are missing or have another shape.
    """
    entries = tensor_metadata(directory)
    missing = sorted(key for key in tensors if key not in entries)
    if missing:
        raise CheckpointError(
            f"{directory}: has no {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    mismatched = [
        f"{key} {tuple(entries[key].size)} (expected {tuple(value.shape)})"
        for key, value in tensors.items()
        if tuple(entries[key].size) != tuple(value.shape)
    ]
    if mismatched:
        raise CheckpointError(f"{directory}: shapes differ: {', '.join(mismatched[:5])}")
    with _plain_errors(directory, "loading"):
        dcp.load(
            tensors,
            storage_reader=SafeFileSystemReader(directory),
            planner=_TensorsOnlyPlanner(),
            process_group=process_group,
            no_dist=alone or not _distributed(),
        )


def empty_like_saved(entry: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


@contextmanager
def _plain_errors(directory: Path, action: str):
    """DCP reports failures as a BaseException carrying every rank's error; make it a CheckpointError
    that says what failed on which rank (and that ``except Exception`` catches)."""
    try:
        yield
    except CheckpointException as err:
        causes = [exception for exception, _ in err.failures.values()]
        if causes and all(isinstance(cause, CheckpointError) for cause in causes):
            raise causes[0] from None
        detail = "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(err.failures.items())
        )
        raise CheckpointError(f"{directory}: {action} failed: {detail}", min(err.failures, default=None)) from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
