"""SwiGLU's gate in Triton: y = silu(a) · b elementwise, and its backward, in one pass each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uma_lightning.kernels.triton_ops.launch import elementwise_block


@triton.jit
def _forward(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    a = tl.load(a_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _backward(dy_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    dy = tl.load(dy_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    # silu'(a) = σ(a) · (1 + a · (1 − σ(a)))
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * a * sig
    tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=ok)
    tl.store(db_ptr + offsets, db.to(db_ptr.dtype.element_ty), mask=ok)


def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(a)
    block = elementwise_block(a.device)
    _forward[(triton.cdiv(a.numel(), block),)](a, b, y, a.numel(), BLOCK=block)
    return y


def backward(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy, a, b = dy.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    block = elementwise_block(a.device)
    _backward[(triton.cdiv(a.numel(), block),)](dy, a, b, da, db, a.numel(), BLOCK=block)
    return da, db
