"""Tensors to and from a checkpoint directory with torch.distributed.checkpoint (DCP), loading only tensors.

DCP writes one ``__<rank>_<n>.distcp`` file per rank and a ``.metadata`` index; tensors saved sharded
(DTensors of FSDP2 or tensor parallelism) load into any other sharding or into plain tensors, which is
what makes a checkpoint loadable under another strategy or world size.

Saving checksums every file while its bytes are written (no second pass reading them back), writes
it in 64 MiB blocks past the page cache (``O_DIRECT``) on a thread of its own while the next block
fills, and records where the time went (``SaveProfile``).

Loading reads each tensor's bytes straight into the tensor it loads into, one large read per tensor,
where the bytes on disk are laid out as that tensor is (same dtype, contiguous). A tensor, or DTensor
shard, saved as one chunk of exactly its place and sizes (a load under the layout that saved it) is
read without DCP's planning, which cost a third as much as the reads of a 1.3 GB checkpoint from a
fast disk; a resharded load is planned by DCP, still reading in place each saved chunk that fills a
contiguous part of its destination; DCP's own path (``torch.load`` of the entry into a new tensor,
then a copy) takes the rest. A tensor on a GPU is read through two pinned host buffers per reader, the
next piece read from disk while the last is copied to the device. The index is unpickled once per
checkpoint directory, not once per use.

Loading never unpickles untrusted objects: DCP reads tensors with ``torch.load(weights_only=True)``,
the in-place reads unpickle a tensor's header with an unpickler that knows only how to describe one
tensor, the ``.metadata`` index (a pickle) is read by an unpickler that resolves only the classes DCP
writes there, and an entry stored as pickled bytes is refused instead of being loaded.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import io
import mmap
import os
import pickle
import struct
import sys
import threading
import time
import warnings
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from zlib_ng.zlib_ng import crc32

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
        """Tensors whose saved chunk fills a contiguous part of their destination (a resharded load) are read in place."""
        items = [i for i in plan.items if i.type == LoadItemType.TENSOR and not any(i.storage_offsets)]
        reads = [
            _InPlace(self.storage_data[i.storage_index], tuple(i.lengths), planner.resolve_tensor(i).detach())
            for i in items
        ]
        read = set()
        for item, in_place, done in zip(items, reads, _read_in_place(Path(self.path), reads)):
            if done:
                planner.commit_tensor(item, in_place.target)
                read.add(id(item))
        rest = [item for item in plan.items if id(item) not in read]
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


def _data_offset(head: bytes, target: torch.Tensor, lengths: tuple) -> Optional[int]:
    """Where, in the entry whose first bytes are ``head``, the bytes of ``target`` lie in its own layout
    (little-endian, contiguous, whole, ``lengths`` long); None when they do not, or the entry is not as expected."""
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
        and tuple(saved.size) == tuple(target.shape) == tuple(lengths)
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


@dataclasses.dataclass(frozen=True)
class _InPlace:
    """A saved chunk (``entry``: file, offset, length; ``lengths``: its sizes) to read into ``target``."""

    entry: _StorageInfo
    lengths: tuple
    target: torch.Tensor


def _read_in_place(directory: Path, reads: list[_InPlace]) -> list[bool]:
    """Read each chunk of ``reads`` straight into its target where the bytes on disk are laid out as the
    target is (and the target is contiguous, on the host or a GPU); False for the others, left untouched.

    The entries, in file order, are cut into ``_READERS`` runs of about equal bytes, each read in order
    (an entry's header, then its data) by a thread of its own, the calling thread one of them: a read
    does not hold the GIL, and handing each of hundreds of entries to a pool cost more than its reads."""
    done = [False] * len(reads)
    by_file: dict[str, list[int]] = defaultdict(list)
    for index, read in enumerate(reads):
        if (
            not read.entry.transform_descriptors
            and read.target.device.type in _READABLE
            and read.target.is_contiguous()
        ):
            by_file[read.entry.relative_path].append(index)
    descriptors, jobs = [], []
    try:
        for relative_path, indices in by_file.items():
            fd = os.open(directory / relative_path, os.O_RDONLY)
            descriptors.append(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            jobs += [(fd, index) for index in sorted(indices, key=lambda index: reads[index].entry.offset)]
        runs = _runs_of_equal_bytes(jobs, lambda job: reads[job[1]].target.nbytes, _READERS)

        def read_run(run: list) -> None:
            staging: dict[torch.device, _DeviceStaging] = {}
            try:
                for fd, index in run:
                    target = reads[index].target
                    if target.device.type != "cpu" and target.device not in staging:
                        staging[target.device] = _DeviceStaging.take(target.device)
                    done[index] = _read_entry(fd, reads[index], staging.get(target.device))
            finally:
                for buffers in staging.values():
                    buffers.give_back()

        with ThreadPoolExecutor(max(len(runs) - 1, 1), thread_name_prefix="checkpoint-reader") as readers:
            rest_of_runs = [readers.submit(read_run, run) for run in runs[1:]]
            read_run(runs[0])
            for run in rest_of_runs:
                run.result()
    finally:
        for fd in descriptors:
            os.close(fd)
    return done


_READABLE = ("cpu", "cuda")


class _DeviceStaging:
    """Two pinned host buffers through which one reader fills tensors on a device: a piece is read
    from disk into one buffer while the other's copy to the device runs on a stream of its own."""

    PIECE = 32 << 20
    _idle: dict[torch.device, list[_DeviceStaging]] = defaultdict(list)  # kept from load to load: pinning costs
    _lock = threading.Lock()

    def __init__(self, device: torch.device, piece: int = PIECE):
        self.device = device
        on_gpu = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpu else None
        self.buffers = [torch.empty(piece, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2)]
        self.copied: list = [None, None]
        self.turn = 0

    @classmethod
    def take(cls, device: torch.device) -> _DeviceStaging:
        with cls._lock:
            staging = cls._idle[device].pop() if cls._idle[device] else None
        staging = staging or cls(device)
        if staging.stream is not None:  # the targets may still be written by work queued on the current stream
            staging.stream.wait_stream(torch.cuda.current_stream(device))
        return staging

    def give_back(self) -> None:
        self.finish()
        with self._lock:
            self._idle[self.device].append(self)

    def fill(self, target: torch.Tensor, read_piece) -> None:
        """Fill ``target``'s bytes piece by piece; ``read_piece(buffer, start)`` fills a host buffer
        with the bytes from ``start`` on."""
        destination = target.view(-1).view(torch.uint8)
        piece = self.buffers[0].numel()
        for start in range(0, destination.numel(), piece):
            length = min(piece, destination.numel() - start)
            buffer = self.buffers[self.turn][:length]
            if self.copied[self.turn] is not None:
                self.copied[self.turn].synchronize()  # the buffer's last copy has left it
            read_piece(memoryview(buffer.numpy()), start)
            if self.stream is None:
                destination[start : start + length].copy_(buffer)
            else:
                with torch.cuda.stream(self.stream):
                    destination[start : start + length].copy_(buffer, non_blocking=True)
                    self.copied[self.turn] = self.stream.record_event()
            self.turn ^= 1

    def finish(self) -> None:
        """Wait for every copy: the tensors are complete when the load returns."""
        if self.stream is not None:
            self.stream.synchronize()


def _runs_of_equal_bytes(jobs: list, nbytes, count: int) -> list[list]:
    """``jobs`` cut, in order, into at most ``count`` runs of about equal ``nbytes`` (at least one run)."""
    total = sum(nbytes(job) for job in jobs) or 1
    runs: list[list] = [[] for _ in range(count)]
    done = 0
    for job in jobs:
        runs[min(count - 1, done * count // total)].append(job)
        done += nbytes(job)
    return [run for run in runs if run] or [[]]


def _read_entry(fd: int, read: _InPlace, staging: Optional[_DeviceStaging] = None) -> bool:
    """Read the entry's data into the target if it is laid out as the target is; False when it is not.
    A target off the host goes through ``staging``."""
    entry, target = read.entry, read.target
    head = os.pread(fd, min(_ENTRY_HEAD, entry.length), entry.offset)
    offset = _data_offset(head, target, read.lengths)
    if offset is None or offset + target.nbytes > entry.length:
        return False

    def read_piece(destination: memoryview, start: int) -> None:
        begin = offset + start
        if begin + destination.nbytes <= len(head):
            destination[:] = head[begin : begin + destination.nbytes]
        else:
            _read_exactly(fd, destination, entry.offset + begin)

    if staging is None:
        read_piece(memoryview(target.view(-1).view(torch.uint8).numpy()), 0)
    else:
        staging.fill(target, read_piece)
    return True


def _read_whole_chunks(
    tensors: dict[str, torch.Tensor], directory: Path, metadata: Metadata
) -> dict[str, torch.Tensor]:
    """Read every tensor (or DTensor shard) that was saved as one chunk of exactly its place and sizes,
    straight into it, without DCP's planning; returns the tensors left to read."""
    keys, reads = [], []
    for key, tensor in tensors.items():
        mine = _local_chunk(tensor)
        saved = [c for c in metadata.state_dict_metadata[key].chunks if c.offsets == mine.offsets]
        entry = metadata.storage_data.get(MetadataIndex(key, mine.offsets))
        if entry is not None and len(saved) == 1 and saved[0].sizes == mine.sizes and 0 not in mine.sizes:
            keys.append(key)
            reads.append(_InPlace(entry, tuple(mine.sizes), local_part(tensor).detach()))
    done = dict(zip(keys, _read_in_place(directory, reads)))
    return {key: tensor for key, tensor in tensors.items() if not done.get(key)}


def _local_chunk(tensor: torch.Tensor) -> ChunkStorageMetadata:
    """Where this process's part of ``tensor`` lies in the whole, as DCP records chunks."""
    if hasattr(tensor, "__create_chunk_list__"):  # a DTensor: its local shard
        chunks = tensor.__create_chunk_list__()
        if len(chunks) == 1:
            return chunks[0]
        return ChunkStorageMetadata(torch.Size([-1]), torch.Size([0]))  # matches no saved chunk
    return ChunkStorageMetadata(torch.Size([0] * tensor.dim()), tensor.shape)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor; a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


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


# Writes shorter than this (zip headers, a tensor's pickle) are copied into the block by a slice assignment;
# longer ones by numpy, which lets go of the GIL.
_SMALL_WRITE = 4096
# A file is written in blocks of this many bytes, 4 KiB-aligned, a thread writing one while the next fills.
# Fewer, larger writes keep the disk busier: 64 MiB blocks saved the `small` model in 0.82 s (median of 5),
# 32 MiB in 0.92 s and 16 MiB in 1.02 s, the raw write taking 0.69 s. Two blocks, kept from save to save.
_BLOCK = 64 * 2**20
_BLOCKS = 2
_ALIGN = 4096  # what O_DIRECT asks of a write's buffer, length and file offset on common disks
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
    """A file being written: its bytes gathered into aligned blocks, each checksummed (CRC-32) when full
    and written by a thread of its own while the next block fills, and an fsync when closed. Only appends, as DCP's
    writer does.

    The file is opened with ``O_DIRECT`` where the file system allows: the blocks go from our buffers to the
    disk, past the page cache. Buffered, a save's writes first fill gigabytes of the page cache, and
    allocating those pages can cost more than the disk itself on a virtual machine (1.3 GB written
    buffered took 0.6 to 3.8 s from run to run, the same bytes written directly 0.4 to 0.9 s); the cache
    also evicts what training reads. The last block is padded to the alignment and the file truncated
    back to its size. Where the file system refuses ``O_DIRECT``, the file is written buffered.
    """

    def __init__(self, path: Path, profile: SaveProfile):
        self._file, self._direct = _open_for_writing(path)
        self._profile = profile
        self.size = 0
        self.crc = 0
        self._free = [_take_block() for _ in range(_BLOCKS)]
        self._filling = self._free.pop()
        self._filling_bytes = np.frombuffer(self._filling, np.uint8)
        self._filled = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-file")
        self._in_flight: deque[tuple[Future, mmap.mmap]] = deque()
        self._failure: Optional[BaseException] = None  # a write that failed fails every later one
        self._seconds = {"checksum": 0.0, "write": 0.0}

    def write(self, data) -> int:
        if self._failure is not None:  # as a failing disk would: torch.save's closing records must not land
            raise self._failure
        view = memoryview(data).cast("B")
        count = len(view)
        if count < _SMALL_WRITE and count < _BLOCK - self._filled:
            # Most writes are a zip header's few bytes (about 35 per tensor): this path is for them.
            end = self._filled + count
            self._filling[self._filled : end] = view
            self._filled = end
            self.size += count
            return count
        started = time.perf_counter()
        copied = 0
        while copied < count:
            piece = min(_BLOCK - self._filled, count - copied)
            # numpy's copy lets go of the GIL, which training needs while a background save writes
            self._filling_bytes[self._filled : self._filled + piece] = np.frombuffer(view, np.uint8, piece, copied)
            self._filled += piece
            copied += piece
            if self._filled == _BLOCK:
                self._send_block(_BLOCK)
        self.size += count
        self._seconds["write"] += time.perf_counter() - started
        return count

    def _send_block(self, length: int) -> None:
        """Checksum the filling block's data (its first ``self._filled`` bytes; the rest up to ``length``
        is padding), queue the block for the file's thread and fill a free one, waiting for one if none
        is. Each block is in one place at any time: filling, in flight or free."""
        block, self._filling = self._filling, None
        # One CRC call per block, not one per write; zlib-ng lets go of the GIL, so it runs while the
        # file's thread writes the block before.
        started = time.perf_counter()
        self.crc = crc32(memoryview(block)[: self._filled], self.crc)
        self._seconds["checksum"] += time.perf_counter() - started
        self._in_flight.append((self._writer.submit(self._write_block, memoryview(block)[:length]), block))
        if not self._free:
            self._wait_for_oldest_write()
        self._filling = self._free.pop()
        self._filling_bytes = np.frombuffer(self._filling, np.uint8)
        self._filled = 0

    def _wait_for_oldest_write(self) -> None:
        writing, block = self._in_flight.popleft()
        self._free.append(block)
        writing.result()

    def _write_block(self, block: memoryview) -> None:
        if self._failure is not None:
            raise self._failure
        while len(block):
            try:
                block = block[self._file.write(block) :]
            except OSError as err:
                if err.errno != errno.EINVAL or not self._direct:
                    self._failure = err
                    raise
                # Opened with O_DIRECT, refused at the write (an alignment this file system finds too
                # small): the rest is written buffered.
                flags = fcntl.fcntl(self._file.fileno(), fcntl.F_GETFL)
                fcntl.fcntl(self._file.fileno(), fcntl.F_SETFL, flags & ~os.O_DIRECT)
                self._direct = False
        if not self._direct:  # start writeback now, so that the fsync has little left to wait for
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        """Nothing: the bytes reach the file in whole blocks, and all of them at ``close``."""

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Write what is left, then fsync and close."""
        if self._file.closed:
            return
        try:
            with self._profile.timed("fsync"):
                if self._filled:
                    padded = -(-self._filled // _ALIGN) * _ALIGN
                    self._filling[self._filled : padded] = bytes(padded - self._filled)
                    self._send_block(padded)
                while self._in_flight:
                    self._wait_for_oldest_write()
                if self._file.seek(0, os.SEEK_END) != self.size:
                    os.ftruncate(self._file.fileno(), self.size)
                os.fsync(self._file.fileno())
        finally:
            self._release()
        for phase, seconds in self._seconds.items():
            self._profile.add(phase, seconds)

    def abandon(self) -> Optional[BaseException]:
        """Close without writing more, after a failure: the file is left as it is, never committed.
        Returns the error a write of this file failed with, if one did."""
        while self._in_flight:
            with suppress(Exception):
                self._wait_for_oldest_write()
        self._release()
        return self._failure

    def _release(self) -> None:
        self._writer.shutdown(wait=True)  # no write is under way after this
        self._file.close()
        blocks = [*self._free, *(block for _, block in self._in_flight)]
        for block in blocks if self._filling is None else [self._filling, *blocks]:
            _give_back_block(block)
        self._free, self._in_flight, self._filling = [], deque(), None


def _open_for_writing(path: Path) -> tuple[io.RawIOBase, bool]:
    """The file, unbuffered, and whether it takes O_DIRECT writes: where the platform and the file system
    allow (a file system that refuses it fails the open with EINVAL), else written through the page cache."""
    if hasattr(os, "O_DIRECT"):
        try:
            return open(path, "wb", buffering=0, opener=_direct_opener), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return open(path, "wb", buffering=0), False


def _direct_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT)


# Aligned blocks (anonymous mmaps are page-aligned) kept from file to file: allocating and first touching
# 128 MiB for every save would cost more than the copies into them.
_free_blocks: list[mmap.mmap] = []
_free_blocks_lock = threading.Lock()


def _take_block() -> mmap.mmap:
    with _free_blocks_lock:
        while _free_blocks:
            block = _free_blocks.pop()
            if len(block) == _BLOCK:  # not one made under another block size (tests change it)
                return block
    return mmap.mmap(-1, _BLOCK)


def _give_back_block(block: mmap.mmap) -> None:
    with _free_blocks_lock:
        _free_blocks.append(block)


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
        stream = _ChecksummedFile(path, self.profile)
        try:
            yield stream
        except BaseException:
            failure = stream.abandon()
            if failure is not None:  # the disk's own error, not what torch.save made of it ("unexpected pos")
                raise failure from None
            raise
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
    reader = SafeFileSystemReader(directory)
    no_dist = alone or not _distributed()
    with _plain_errors(directory, "loading"):
        rest = _read_whole_chunks(tensors, Path(directory), reader.read_metadata())
        if rest or not no_dist:  # collective: every rank joins, even with nothing left to read
            dcp.load(
                rest, storage_reader=reader, planner=_TensorsOnlyPlanner(), process_group=process_group, no_dist=no_dist
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
