"""Cross-entropy over one chunk of logit rows in Triton, writing the logits' gradient in place.

One program per row streams the row twice: first an online max / sum of exponentials (and the
argmax), then softmax − one-hot, scaled by the row's weight in the loss, over the logits themselves. The
caller multiplies that gradient into the hidden-state and weight gradients and drops it, so no
full-vocabulary tensor outlives its chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Stands in for -inf in running maxima, so that rescaling lanes that saw no column yet stays finite.
_VERY_NEGATIVE = tl.constexpr(-1.0e30)


@triton.jit
def _rows(
    logits_ptr, targets_ptr, row_weight_ptr, loss_ptr, pred_ptr, n_cols, row_stride, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), _VERY_NEGATIVE, tl.float32)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    run_arg = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        ok = cols < n_cols
        x = tl.where(ok, tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), _VERY_NEGATIVE)
        run_arg = tl.where(x > run_max, cols.to(tl.int64), run_arg)
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.where(ok, tl.exp(x - new_max), 0.0)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    # The first column holding the maximum, as torch.argmax returns.
    pred = tl.min(tl.where(run_max == row_max, run_arg, n_cols), axis=0)

    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(base + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    tl.store(pred_ptr + row, pred)

    scale = tl.where(valid, tl.load(row_weight_ptr + row), 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        ok = cols < n_cols
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) * scale
        grad = tl.where(cols == safe_target, grad - scale, grad)
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=ok)


def rows_in_place(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    losses: torch.Tensor,
    predictions: torch.Tensor,
    ignore_index: int,
) -> None:
    """Per-row loss and argmax into ``losses``/``predictions``; ``logits`` becomes d(loss)/d(logits)."""
    n_rows, n_cols = logits.shape
    block = min(triton.next_power_of_2(n_cols), 4096)
    _rows[(n_rows,)](
        logits,
        targets,
        row_weights,
        losses,
        predictions,
        n_cols,
        logits.stride(0),
        ignore_index,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
