"""Rotary position embedding in Triton, for x [B, H, S, D] in any memory layout with unit last stride.

Channel pairs (x[..., i], x[..., i + D/2]) turn by the angle of their position; the backward is
the same turn backwards, so one kernel serves both with ``sign`` = +1 or -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uma_lightning.kernels.triton_ops.launch import row_tile


@triton.jit
def _rotate(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    n_rows,
    n_heads,
    seq_len,
    half,
    table_stride,
    x_sb,
    x_sh,
    x_ss,
    y_sb,
    y_sh,
    y_ss,
    sign,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Rows enumerate (batch, head, position) in that order; each row holds D channels.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    pos = rows % seq_len
    head = (rows // seq_len) % n_heads
    batch = rows // (seq_len * n_heads)
    cols = tl.arange(0, BLOCK_HALF)
    tile = row_ok[:, None] & (cols < half)[None, :]
    x_at = (batch * x_sb + head * x_sh + pos * x_ss)[:, None] + cols[None, :]
    y_at = (batch * y_sb + head * y_sh + pos * y_ss)[:, None] + cols[None, :]
    angle_at = pos[:, None] * table_stride + cols[None, :]
    x1 = tl.load(x_ptr + x_at, mask=tile, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_at + half, mask=tile, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + angle_at, mask=tile, other=0.0)
    sin = tl.load(sin_ptr + angle_at, mask=tile, other=0.0) * sign
    tl.store(y_ptr + y_at, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=tile)
    tl.store(y_ptr + y_at + half, (x1 * sin + x2 * cos).to(y_ptr.dtype.element_ty), mask=tile)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [B, H, S, D] turned by the angles in cos/sin [>= S, D/2] (float32), or turned back if ``inverse``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    batch, heads, seq, dim = x.shape
    y = torch.empty_like(x)  # keeps x's layout, e.g. [B, S, H, D] memory seen as [B, H, S, D]
    n_rows = batch * heads * seq
    block_rows, block_half, warps = row_tile(n_rows, dim // 2)
    _rotate[(triton.cdiv(n_rows, block_rows),)](
        x,
        cos,
        sin,
        y,
        n_rows,
        heads,
        seq,
        dim // 2,
        cos.stride(0),
        x.stride(0),
        x.stride(1),
        x.stride(2),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        -1.0 if inverse else 1.0,
        BLOCK_ROWS=block_rows,
        BLOCK_HALF=block_half,
        num_warps=warps,
    )
    return y
