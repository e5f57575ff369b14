"""Tensors to and from a checkpoint directory with torch.distributed.checkpoint (DCP), loading only tensors.

DCP writes one ``__<rank>_<n>.distcp`` file per rank and a ``.metadata`` index; tensors saved sharded
(DTensors of FSDP2 or tensor parallelism) load into any other sharding or into plain tensors, which is
what makes a checkpoint loadable under another strategy or world size.

Saving checksums every file while its bytes are written (no second pass reading them back), starts
the disk writing each 64 MiB as soon as it is written, so the final fsync has little left to wait for,
and records where the time went (``SaveProfile``).

Loading reads each tensor's bytes straight into the tensor it loads into, one large read per tensor,
where the bytes on disk are laid out as that tensor is (same dtype, contiguous, not resharded); DCP's
own path (``torch.load`` of the entry into a new tensor, then a copy) takes the rest. The index is
unpickled once per checkpoint directory, not once per use.

Loading never unpickles untrusted objects: DCP reads tensors with ``torch.load(weights_only=True)``,
the in-place reads unpickle a tensor's header with an unpickler that knows only how to describe one
tensor, the ``.metadata`` index (a pickle) is read by an unpickler that resolves only the classes DCP
writes there, and an entry stored as pickled bytes is refused instead of being loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import struct
import sys
import threading
import time
import warnings
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

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
    """DCP's file reader, with the ``.metadata`` index read by the restricted unpickler, and tensors
    read in place where they can be (see the module docstring)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            status = path.stat()
        except OSError as err:
            raise CheckpointError(f"{path}: not a valid checkpoint index: {err}") from None
        metadata = _read_index(path, status.st_ino, status.st_mtime_ns, status.st_size)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        rest = _read_in_place(Path(self.path), self.storage_data, plan.items, planner)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


@functools.lru_cache(maxsize=4)
def _read_index(path: Path, inode: int, mtime_ns: int, size: int) -> Metadata:
    """The unpickled index; keyed by the file's identity, so a rewritten index is read again."""
    try:
        with open(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, OSError) as err:
        raise CheckpointError(f"{path}: not a valid checkpoint index: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not a valid checkpoint index")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


# The head of a DCP tensor entry (a torch.save zip) read to find its data: the pickle that describes
# the tensor and the zip headers up to the data record fit in this many bytes.
_ENTRY_HEAD = 4096
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
_READERS = 2
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


@dataclasses.dataclass(frozen=True)
class _SavedTensor:
    dtype: torch.dtype
    numel: int  # of its storage
    storage_offset: int
    size: tuple
    stride: tuple


class _TensorHeaderUnpickler(pickle.Unpickler):
    """Reads the pickle ``torch.save`` writes for one tensor into a ``_SavedTensor``; anything else fails."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: _SavedTensor(storage[0], storage[1], offset, size, stride)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor's header")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[2] == "0"):
            raise pickle.UnpicklingError("not a tensor's single storage")
        return pid[1], pid[4]


def _data_offset(head: bytes, target: torch.Tensor, item: ReadItem) -> Optional[int]:
    """Where, in the entry whose first bytes are ``head``, the bytes of ``target`` lie in its own layout
    (little-endian, contiguous, whole); None when they do not, or the entry is not as expected."""
    try:
        name_length, extra_length = struct.unpack_from("<HH", head, 26)
        start = 30 + name_length + extra_length
        if head[:4] != _ZIP_LOCAL_HEADER or not head[30 : 30 + name_length].endswith(b"/data.pkl"):
            return None
        stream = io.BytesIO(head[start:])
        saved = _TensorHeaderUnpickler(stream).load()
        position = start + stream.tell()
    except (pickle.UnpicklingError, struct.error, EOFError, TypeError, ValueError, IndexError):
        return None
    if not (
        isinstance(saved, _SavedTensor)
        and saved.dtype == target.dtype
        and saved.storage_offset == 0
        and saved.numel == target.numel()
        and tuple(saved.size) == tuple(target.shape) == tuple(item.lengths)
        and not any(item.storage_offsets)
        and tuple(saved.stride) == torch.empty(saved.size, device="meta").stride()
    ):
        return None
    little_endian = False
    while (position := head.find(_ZIP_LOCAL_HEADER, position)) >= 0 and position + 30 <= len(head):
        name_length, extra_length = struct.unpack_from("<HH", head, position + 26)
        name = head[position + 30 : position + 30 + name_length]
        data = position + 30 + name_length + extra_length
        if name.endswith(b"/byteorder"):
            little_endian = head[data : data + 6] == b"little"
        elif name.endswith(b"/data/0"):
            return data if little_endian and sys.byteorder == "little" else None
        position = data
    return None


def _read_in_place(directory: Path, storage_data: dict, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
    """Read the tensors of ``items`` that can be read straight into their destination; returns the others.

    ``_READERS`` threads take the entries in file order (a read does not hold the GIL), each reading an
    entry's header and then its data, so the reads stay sequential with a few always queued."""
    by_file: dict[str, list] = defaultdict(list)
    rest = []
    for item in items:
        entry = storage_data[item.storage_index]
        if item.type == LoadItemType.TENSOR and not entry.transform_descriptors:
            by_file[entry.relative_path].append((entry, item))
        else:
            rest.append(item)
    descriptors, jobs = [], []
    try:
        for relative_path, entries in by_file.items():
            fd = os.open(directory / relative_path, os.O_RDONLY)
            descriptors.append(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for entry, item in sorted(entries, key=lambda pair: pair[0].offset):
                target = planner.resolve_tensor(item).detach()
                if target.device.type == "cpu" and target.is_contiguous():
                    jobs.append((fd, entry, item, target))
                else:
                    rest.append(item)
        with ThreadPoolExecutor(_READERS, thread_name_prefix="checkpoint-reader") as readers:
            read = list(readers.map(lambda job: _read_entry(*job), jobs))
    finally:
        for fd in descriptors:
            os.close(fd)
    for (_, _, item, target), done in zip(jobs, read):
        if done:
            planner.commit_tensor(item, target)
        else:
            rest.append(item)
    return rest


def _read_entry(fd: int, entry, item: ReadItem, target: torch.Tensor) -> bool:
    """Read the entry's data into ``target`` if it is laid out as ``target`` is; False when it is not."""
    head = os.pread(fd, min(_ENTRY_HEAD, entry.length), entry.offset)
    offset = _data_offset(head, target, item)
    if offset is None or offset + target.nbytes > entry.length:
        return False
    destination = memoryview(target.view(-1).view(torch.uint8).numpy())
    if offset + target.nbytes <= len(head):
        destination[:] = head[offset : offset + target.nbytes]
    else:
        _read_exactly(fd, destination, entry.offset + offset)
    return True


def _read_exactly(fd: int, destination: memoryview, offset: int) -> None:
    done = 0
    while done < destination.nbytes:
        count = os.preadv(fd, [destination[done:]], offset + done)
        if count == 0:
            raise CheckpointError(f"file ends {destination.nbytes - done} bytes early at offset {offset + done}")
        done += count


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
