"""Fused linear + cross-entropy: the mean loss of ``hidden @ weightᵀ`` against targets, in row chunks.

The unfused loss materialises logits [N, V] plus their softmax and gradient, which dominates
memory for large vocabularies. Here each chunk of rows computes its logits, its loss and the
logits' gradient, folds that gradient into d(hidden) and d(weight) at once, and frees it: the
only vocabulary-sized buffers are one chunk's logits and d(weight). The gradients are computed in
the forward (when autograd needs them) and scaled by the incoming gradient in the backward.

``torch`` runs the chunk's softmax and gradient with eager ops; ``triton`` with one kernel that
streams each row twice and overwrites the logits with their gradient. Both are chunked, so both
save the memory; ``F.cross_entropy(hidden @ weight.T, targets)`` is the unfused reference.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from uma_lightning.kernels.dispatch import resolve

MIN_CHUNK_ROWS = 128  # below this the chunk's matmuls get too thin to run well


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    backend: str = "auto",
    per_sample: bool = False,
) -> tuple[Tensor, Tensor]:
    """(mean loss over targets != ignore_index, argmax predictions shaped like targets).

    hidden [..., D], weight [V, D] (a bias-free head), targets [...] int. The loss is float32, or
    float64 for float64 inputs (the parity check compares layouts in float64).
    With ``per_sample`` (targets [B, T]) the loss is the mean over samples of each sample's mean
    over its counted tokens, so equal shards of a batch average to the whole batch's loss, as
    data-parallel ranks do; otherwise it is the mean over all counted tokens.
    Under autocast the matmuls run in the autocast dtype, as ``nn.Linear`` would.
    """
    # Plain tensors only (the op has no DTensor sharding rule): a tensor-parallel plan gathers the
    # head's weight before the call and hands its gradient back to the shards.
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    use_triton = resolve("cross_entropy", backend, device_type, hidden.dtype) == "triton"
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        loss, predictions, _, _ = torch.ops.uma.linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            _row_weights(targets, ignore_index, per_sample, _accumulation_dtype(hidden.dtype)),
            ignore_index,
            use_triton,
            needs_grad,
        )
    return loss, predictions.view(targets.shape)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _row_weights(targets: Tensor, ignore_index: int, per_sample: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """Each target's weight in the loss (flat, in ``dtype``): tensors throughout, so no host sync."""
    valid = (targets != ignore_index).to(dtype)
    if not per_sample:
        return (valid / valid.sum().clamp(min=1)).reshape(-1)
    if targets.dim() != 2:
        raise ValueError(f"per_sample needs targets shaped [batch, tokens], got {tuple(targets.shape)}")
    return (valid / valid.sum(1, keepdim=True).clamp(min=1) / targets.shape[0]).reshape(-1)


def chunk_rows(n_rows: int, dim: int, vocab: int) -> int:
    """Rows per chunk: one chunk's logits about the size of the hidden states, at least MIN_CHUNK_ROWS."""
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, n_rows * dim // vocab)))


@torch.library.custom_op("uma::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    row_weights: Tensor,
    ignore_index: int,
    use_triton: bool,
    needs_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, predictions, d loss/d hidden, d loss/d weight); the gradients are empty unless ``needs_grad``."""
    n_rows = hidden.shape[0]
    losses = torch.empty(n_rows, dtype=_accumulation_dtype(hidden.dtype), device=hidden.device)
    predictions = torch.empty(n_rows, dtype=torch.int64, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs_grad else hidden.new_empty(0)
    grad_weight = (
        torch.zeros(weight.shape, dtype=_accumulation_dtype(weight.dtype), device=weight.device)
        if needs_grad
        else weight.new_empty(0)
    )
    rows_in_place = _triton_rows if use_triton else _torch_rows
    # The logits' gradient is written with the row weights over their largest, and that scale is
    # applied to the two products: weighted in full (1/tokens), a float16 gradient underflows (a
    # probability of 3e-5 over 3072 tokens is below float16's smallest number, 6e-8).
    scale = row_weights.max().clamp(min=torch.finfo(row_weights.dtype).tiny)
    relative_weights = row_weights / scale
    step = chunk_rows(n_rows, hidden.shape[1], weight.shape[0])
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        chunk = hidden[rows]
        logits = chunk @ weight.T
        rows_in_place(logits, targets[rows], relative_weights[rows], losses[rows], predictions[rows], ignore_index)
        if needs_grad:  # logits now hold d loss/d logits over the scale
            torch.mm(logits, weight, out=grad_hidden[rows]).mul_(scale)  # scaled in float32, rounded once
            if grad_weight.dtype == chunk.dtype:
                grad_weight.addmm_(logits.T, chunk)  # in place: no vocabulary-sized temporary
            else:
                grad_weight.add_(logits.T @ chunk)  # half precision products, float32 sum over chunks
    return (
        (losses * row_weights).sum(),
        predictions,
        grad_hidden,
        grad_weight.mul_(scale).to(weight.dtype) if needs_grad else grad_weight,
    )


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, row_weights, ignore_index, use_triton, needs_grad):
    grad_hidden = hidden.new_empty(hidden.shape if needs_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if needs_grad else (0,))
    return (
        hidden.new_empty((), dtype=_accumulation_dtype(hidden.dtype)),
        targets.new_empty(targets.shape, dtype=torch.int64),
        grad_hidden,
        grad_weight,
    )


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[2], output[3])


def _backward(ctx, grad_loss, _predictions, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden.numel() == 0 and grad_weight.numel() == 0:
        raise RuntimeError("linear_cross_entropy ran without gradients (grad mode was off or no input required grad)")
    # Scaled out of place, so a second backward through the same graph gets the same gradients: the
    # zero-bubble pipeline schedules run one for the input's gradient, then one for the weight's.
    return (
        grad_hidden * grad_loss.to(grad_hidden.dtype),
        grad_weight * grad_loss.to(grad_weight.dtype),
        None,
        None,
        None,
        None,
        None,
    )


_linear_cross_entropy.register_autograd(_backward, setup_context=_save)


@register_flop_formula(torch.ops.uma.linear_cross_entropy)
def _linear_cross_entropy_flops(hidden_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """What the flop counter counts for the op, which it cannot see into: the logits' matmul, and
    with ``needs_grad`` (the last argument) the two gradient matmuls done in the forward."""
    rows, dim = hidden_shape
    needs_grad = args[-1] if args else kwargs["needs_grad"]
    return 2 * rows * dim * weight_shape[0] * (3 if needs_grad else 1)


def _triton_rows(logits, targets, row_weights, losses, predictions, ignore_index) -> None:
    from uma_lightning.kernels.triton_ops import cross_entropy as kernel

    kernel.rows_in_place(logits, targets, row_weights.contiguous(), losses, predictions, ignore_index)


def _torch_rows(
    logits: Tensor, targets: Tensor, row_weights: Tensor, losses: Tensor, predictions: Tensor, ignore_index: int
) -> None:
    """The Triton kernel's contract in eager PyTorch: losses, argmax, and logits := d loss/d logits."""
    x = logits.to(losses.dtype)
    lse = x.logsumexp(dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)
    losses.copy_(torch.where(valid, lse - x.gather(1, safe_targets[:, None]).squeeze(1), 0.0))
    predictions.copy_(x.argmax(dim=-1))
    grad = x.sub_(lse[:, None]).exp_()
    grad[torch.arange(len(targets), device=grad.device), safe_targets] -= 1.0
    logits.copy_(grad.mul_((valid * row_weights)[:, None]))
