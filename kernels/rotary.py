"""Rotary position embedding: channel pairs (x[..., i], x[..., i + D/2]) turned by position-dependent angles.

x is [B, H, S, D]; cos and sin are [>= S, D/2] tables. ``torch`` computes in float32 (float64 for float64 x) with eager
ops; ``triton`` turns q or k in one pass, keeping their memory layout, and its backward is the
same kernel turning the other way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from uma_lightning.kernels.dispatch import resolve


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, backend: str = "auto") -> Tensor:
    if resolve("rotary", backend, x.device.type, x.dtype) == "triton":
        return torch.ops.uma.rotary(x, cos, sin, False)
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)  # float64 stays float64
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


@torch.library.custom_op("uma::rotary", mutates_args=())
def _rotary(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    from uma_lightning.kernels.triton_ops import rotary as kernel

    return kernel.rotate(x, cos, sin, inverse)


@_rotary.register_fake
def _(x, cos, sin, inverse):
    return torch.empty_like(x if x.stride(-1) == 1 else x.contiguous())


def _save(ctx, inputs, output) -> None:
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.uma.rotary(dy, cos, sin, not ctx.inverse), None, None, None


_rotary.register_autograd(_backward, setup_context=_save)
