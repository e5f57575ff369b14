"""Launch sizes shared by the kernels: tile shapes and how many programs to start."""

from __future__ import annotations

import functools

import torch
import triton

MAX_ROW_LENGTH = 65536  # longest row a kernel holds in one tile


def row_tile(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(rows per tile, padded row length, warps) for kernels that hold whole rows in registers.

    About 4k elements per tile keeps register use flat whatever the row length; short rows get
    several per tile, which also keeps Triton's CPU interpreter (one step per program) quick.
    """
    if n_cols > MAX_ROW_LENGTH:
        raise ValueError(f"rows of {n_cols} elements exceed the Triton kernels' limit of {MAX_ROW_LENGTH}")
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = min(max(1, 4096 // block_cols), triton.next_power_of_2(max(n_rows, 1)))
    warps = 4 if block_cols <= 2048 else 8 if block_cols <= 8192 else 16
    return block_rows, block_cols, warps


def program_budget(device: torch.device) -> int:
    """Programs for kernels that loop over rows: a few per streaming multiprocessor on a GPU."""
    if device.type != "cuda":
        return 4
    return 4 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def elementwise_block(device: torch.device) -> int:
    """Elements per program for elementwise kernels; the interpreter runs far faster on big blocks."""
    return 1024 if device.type == "cuda" else 16384
