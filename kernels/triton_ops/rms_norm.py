"""RMSNorm in Triton: y = x / sqrt(mean(x²) + eps) * w over the last dimension, and its backward.

Each program normalises a tile of whole rows. The backward gives each program a run of rows, so
it can accumulate its share of the weight gradient in registers; the partial sums are added up
in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uma_lightning.kernels.triton_ops.launch import program_budget, row_tile


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    tile = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=tile, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=tile)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _backward(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for start in range(0, rows_per_program, BLOCK_ROWS):
        rows = first + start + tl.arange(0, BLOCK_ROWS)
        row_ok = (rows < n_rows) & (rows < first + rows_per_program)
        tile = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=tile, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=tile, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        # d/dx of x·rstd(x): rstd · (g − x̂ · mean(g · x̂))
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=tile)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=col_ok)


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) for x [..., n] (made contiguous); rstd is float32 [...]."""
    x = x.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    block_rows, block_cols, warps = row_tile(n_rows, n_cols)
    _forward[(triton.cdiv(n_rows, block_rows),)](
        x, weight, y, rstd, n_rows, n_cols, eps, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps
    )
    return y, rstd


def backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dy, x = dy.contiguous(), x.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block_rows, block_cols, warps = row_tile(n_rows, n_cols)
    programs = min(triton.cdiv(n_rows, block_rows), program_budget(x.device))
    rows_per_program = triton.cdiv(n_rows, programs)
    dx = torch.empty_like(x)
    dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    _backward[(programs,)](
        dy,
        x,
        weight,
        rstd,
        dx,
        dw_partial,
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)
