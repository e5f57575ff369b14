"""Named tensors carved out of one block of shared memory.

A block is one ``torch`` shared-memory storage (one file descriptor, unlinked from /dev/shm as soon
as it is created, so nothing is left behind when a process crashes). It pickles to a spawned process
as a handle to the same memory, so a trajectory chunk written by an actor is read by the learner
without copying through a pipe.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Optional

import torch

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]

_ALIGN = 64  # bytes; keeps every array cache-line aligned and valid for any dtype view


class SharedArrays:
    def __init__(self, layout: Layout, block: Optional[torch.Tensor] = None):
        self.layout = dict(layout)
        offsets, total = {}, 0
        for name, (shape, dtype) in self.layout.items():
            offsets[name] = total
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        if block is None:
            block = torch.zeros(max(total, 1), dtype=torch.uint8).share_memory_()
        elif block.numel() < total:
            raise ValueError(f"shared block of {block.numel()} bytes is smaller than its layout ({total} bytes)")
        self.block = block
        self.tensors = {name: _view(block, offsets[name], shape, dtype) for name, (shape, dtype) in self.layout.items()}
        # numpy views for per-step writes from Python, which are several times cheaper than tensor indexing.
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}

    def __reduce__(self):
        return SharedArrays, (self.layout, self.block)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def copy(self) -> dict[str, torch.Tensor]:
        """A private copy of every array, made with one memcpy of the block."""
        return SharedArrays(self.layout, self.block.clone()).tensors


def _view(block: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return block[offset : offset + math.prod(shape) * size].view(dtype).view(shape)


# Control messages between processes are two int64s written with one write(2) on a pipe. Writes of
# up to PIPE_BUF bytes are atomic, so a process killed mid-send can never leave half a message for
# the next reader (multiprocessing's send_bytes writes a length header and a payload separately).
_MESSAGE = struct.Struct("<qq")


def send_message(conn, first: int, second: int = 0) -> None:
    os.write(conn.fileno(), _MESSAGE.pack(first, second))


def recv_message(conn) -> Optional[tuple[int, int]]:
    """The next message, or None when every writer has closed the pipe (the other process is gone)."""
    data = os.read(conn.fileno(), _MESSAGE.size)
    if not data:
        return None
    while len(data) < _MESSAGE.size:  # not expected for atomic writes; kept for safety
        more = os.read(conn.fileno(), _MESSAGE.size - len(data))
        if not more:
            return None
        data += more
    return _MESSAGE.unpack(data)
