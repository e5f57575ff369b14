"""RMSNorm over the last dimension: y = x / sqrt(mean(x²) + eps) · weight.

``torch`` is ``F.rms_norm``; ``triton`` is a fused kernel whose backward recomputes x̂ from the
saved 1/rms instead of keeping it. The output has x's dtype (under autocast the residual stream
is float32, so norms stay in float32 there too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from uma_lightning.kernels.dispatch import resolve


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> Tensor:
    if resolve("rms_norm", backend, x.device.type, x.dtype) == "triton":
        return torch.ops.uma.rms_norm(x, weight, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight if weight.dtype == x.dtype else weight.to(x.dtype), eps)


@torch.library.custom_op("uma::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from uma_lightning.kernels.triton_ops import rms_norm as kernel

    return kernel.forward(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("uma::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    from uma_lightning.kernels.triton_ops import rms_norm as kernel

    return kernel.backward(dy, x, weight, rstd)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), torch.empty_like(weight)


def _save(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _rstd_grad):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.uma.rms_norm_backward(dy, x, weight, rstd)
    return dx, dweight, None


_rms_norm.register_autograd(_backward, setup_context=_save)
