"""SwiGLU's gate: silu(gate) · up, the elementwise middle of the feed-forward block.

``torch`` is two eager ops (and keeps silu(gate) for the backward); ``triton`` is one fused kernel
each way that keeps only its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from uma_lightning.kernels.dispatch import resolve


def swiglu(gate: Tensor, up: Tensor, backend: str = "auto") -> Tensor:
    if resolve("swiglu", backend, gate.device.type, gate.dtype) == "triton":
        return torch.ops.uma.swiglu(gate, up)
    return F.silu(gate) * up


@torch.library.custom_op("uma::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    from uma_lightning.kernels.triton_ops import swiglu as kernel

    return kernel.forward(gate, up)


@_swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("uma::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    from uma_lightning.kernels.triton_ops import swiglu as kernel

    return kernel.backward(dy, gate, up)


@_swiglu_backward.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.uma.swiglu_backward(dy, gate, up)


_swiglu.register_autograd(_backward, setup_context=_save)
