"""The experts of a mixture-of-experts layer: one SwiGLU feed-forward per expert over its own tokens.

Tokens arrive sorted by expert, ``counts[e]`` of them for expert ``e``; the weights are stacked,
``w1`` and ``w3`` [E, dim, hidden] and ``w2`` [E, hidden, dim]. Backends:

- ``loop``: one matmul per expert over its slice, the reference;
- ``grouped``: ``torch._grouped_mm``, one call for all experts per projection. It needs every row
  stride to be a multiple of 16 bytes (dim and hidden multiples of 4 in float32, 8 in bfloat16);
- ``auto``: grouped where the shapes and the dtype allow it (grouped_mm has no float64, which
  ``uma parity`` computes in), the loop otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from uma_lightning.kernels.dispatch import EXPERT_BACKENDS, log_once
from uma_lightning.kernels.swiglu import swiglu

_ALIGNMENT_BYTES = 16
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_feed_forward(
    x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, backend: str = "auto", swiglu_backend: str = "auto"
) -> Tensor:
    """[T, dim] outputs of tokens x [T, dim], sorted by expert with ``counts`` [E] tokens each."""
    if _resolve(backend, x, w1) == "grouped":
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = _grouped(x, w1, offsets), _grouped(x, w3, offsets)
        return _grouped(swiglu(gate, up, backend=swiglu_backend), w2, offsets)
    outputs = []
    for expert, tokens in enumerate(x.split(counts.tolist())):
        outputs.append(swiglu(tokens @ w1[expert], tokens @ w3[expert], backend=swiglu_backend) @ w2[expert])
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[-1])


def grouped_shapes_aligned(dim: int, hidden: int, dtype: torch.dtype) -> bool:
    element = torch.empty(0, dtype=dtype).element_size()
    return all(size * element % _ALIGNMENT_BYTES == 0 for size in (dim, hidden))


def _resolve(backend: str, x: Tensor, w1: Tensor) -> str:
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"kernels.experts: unknown backend {backend!r} (choose from {', '.join(EXPERT_BACKENDS)})")
    if backend == "loop":
        return "loop"
    aligned = grouped_shapes_aligned(w1.shape[1], w1.shape[2], x.dtype)
    if backend == "grouped":
        if not aligned:
            raise ValueError(
                f"kernels.experts=grouped needs dim and expert hidden sizes whose rows are multiples of {_ALIGNMENT_BYTES} bytes "
                f"in {x.dtype}; got dim {w1.shape[1]}, hidden {w1.shape[2]} (use loop or auto)"
            )
        return "grouped"
    supported = x.dtype in _GROUPED_DTYPES
    choice = "grouped" if aligned and supported else "loop"
    why = (
        "aligned shapes"
        if choice == "grouped"
        else "rows not 16-byte aligned"
        if supported
        else f"grouped_mm has no {x.dtype}"
    )
    log_once(f"kernel experts: {choice} (auto: {why})")
    return choice


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward rejects the
    zero-stride gradients that a sum or an expand produces."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _grouped(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return _ContiguousGradient.apply(torch._grouped_mm(x.contiguous(), weight, offs=offsets))


# torch's flop counter has no formula for the grouped matmul. Every row of ``mat_a`` meets one
# expert's [K, N] weight, whichever it is, so the count follows from the shapes alone (and so holds
# on fake tensors, where the offsets have no values).
@register_flop_formula(torch.ops.aten._grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
