"""Tensors to and from a checkpoint directory with torch.distributed.checkpoint (DCP), loading only tensors.

DCP writes one ``__<rank>_<n>.distcp`` file per rank and a ``.metadata`` index; tensors saved sharded
(DTensors of FSDP2 or tensor parallelism) load into any other sharding or into plain tensors, which is
what makes a checkpoint loadable under another strategy or world size.

Loading never unpickles untrusted objects: DCP reads tensors with ``torch.load(weights_only=True)``,
its ``.metadata`` index (a pickle) is read by an unpickler that resolves only the classes DCP writes
there, and an entry stored as pickled bytes is refused instead of being loaded.
"""

from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, process_group: Optional[dist.ProcessGroup]) -> None:
    """Write ``tensors`` (plain tensors or DTensors, on any device) to ``directory``, every file fsynced.
    Collective over ``process_group`` when distributed."""
    with _plain_errors(directory, "writing"):
        dcp.save(
            tensors,
            storage_writer=FileSystemWriter(directory, single_file_per_rank=True, sync_files=True),
            process_group=process_group,
            no_dist=not _distributed(),
        )


def load_tensors(
    tensors: dict[str, torch.Tensor], directory: str | Path, process_group: Optional[dist.ProcessGroup]
) -> None:
    """Fill ``tensors`` in place from ``directory``, resharding as needed (each rank reads what it holds).

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
            no_dist=not _distributed(),
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
        raise CheckpointError(f"{directory}: {action} failed: {detail}") from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
