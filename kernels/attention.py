"""The one attention entry point every model calls.

Tensors use the SDPA layout: q [B, H, S, D], k and v [B, H_kv, S, D] with H % H_kv == 0
(grouped-query attention). The mask is described, not materialised, by the caller:

- ``causal=False``: every token sees every token;
- ``causal=True, prefix_len=0``: plain causal;
- ``causal=True, prefix_len=P``: block-causal, as pi0-style policies use. Tokens [0, P) (language,
  images, state) see each other bidirectionally; later tokens (actions) see the whole prefix and
  earlier actions only.
- ``key_padding_mask`` [B, S], True where a key is real, hides padding (e.g. short instructions).
  Outputs at padded positions are unspecified (flash-attn leaves them zero); a query that sees no
  key at all gets zeros.

Backends:

- ``flash_attn``: the flash-attn 2 package (``pip install 'uma-lightning[flash]'``); block-causal
  runs as two calls, padding through the variable-length interface;
- ``flash_attn_4``: the FlashAttention-4 CuTe package for Hopper and Blackwell, the same way;
- ``sdpa``: PyTorch's scaled_dot_product_attention, which picks its fused kernel per call;
  ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient`` and ``sdpa_math`` pin one of its kernels;
- ``reference``: plain matmul-softmax-matmul in float32, the ground truth for tests;
- ``auto``: flash-attn where installed and usable (CUDA, half precision, head dim it supports),
  else ``sdpa``; the choice is logged once.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.utils.flop_counter import register_flop_formula

from uma_lightning.kernels import flash
from uma_lightning.kernels.dispatch import (
    ATTENTION_BACKENDS,
    SDPA_KERNELS,
    assume_constant_result,
    did_you_mean,
    log_once,
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    prefix_len: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}{did_you_mean(backend, ATTENTION_BACKENDS)}; "
            f"choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not 0 <= prefix_len <= q.shape[2]:
        raise ValueError(f"prefix_len={prefix_len} outside [0, seq_len={q.shape[2]}]")
    if backend == "auto":
        index = q.device.index if q.device.index is not None else -1
        backend = auto_backend(q.device.type, index, q.dtype, q.shape[-1])
    if backend in flash.PACKAGES:
        functions = flash.load(backend)
        flash.check_inputs(backend, q)
        return flash.flash_attention(
            q, k, v, causal=causal, prefix_len=prefix_len, key_padding_mask=key_padding_mask, functions=functions
        )
    mask = build_mask(
        q.shape[2], causal=causal, prefix_len=prefix_len, key_padding_mask=key_padding_mask, device=q.device
    )
    if backend == "reference":
        return reference_attention(q, k, v, mask=mask, causal=causal)
    return _sdpa(q, k, v, mask=mask, causal=causal, backend=backend)


def _sdpa(q, k, v, *, mask: torch.Tensor | None, causal: bool, backend: str) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    pinned = sdpa_kernel(SDPA_KERNELS[backend]) if backend in SDPA_KERNELS else contextlib.nullcontext()
    try:
        with pinned:
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    except RuntimeError as err:
        if backend not in SDPA_KERNELS:
            raise
        what = f"{q.dtype} head_dim {q.shape[-1]} on {q.device.type}, {'a mask' if mask is not None else 'causal' if causal else 'no mask'}"
        raise RuntimeError(
            f"attention backend {backend!r} cannot run {what}: {str(err).splitlines()[0]}; use 'sdpa' to let PyTorch choose"
        ) from None


def build_mask(
    seq_len: int,
    *,
    causal: bool,
    prefix_len: int,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask, True where a query may attend a key; None when ``causal`` alone says it all."""
    if not 0 <= prefix_len <= seq_len:
        raise ValueError(f"prefix_len={prefix_len} outside [0, seq_len={seq_len}]")
    structural = None
    if causal and prefix_len > 1:
        structural = _block_causal(seq_len, prefix_len, device)
    elif causal and key_padding_mask is not None:
        structural = _block_causal(seq_len, 0, device)
    if key_padding_mask is None:
        return structural
    keys = key_padding_mask[:, None, None, :].to(torch.bool)  # [B, 1, 1, S]
    return keys if structural is None else keys & structural


def _block_causal(seq_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    if not torch.compiler.is_compiling() and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE):
        # A step counted on fake tensors (``modules/flops.py``): its mask must not be cached for real steps.
        return _block_causal_mask(seq_len, prefix_len, device)
    return _cached_block_causal(seq_len, prefix_len, device)


def _block_causal_mask(seq_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(seq_len, device=device)
    causal = idx[:, None] >= idx[None, :]
    in_prefix = idx < prefix_len
    return causal | (in_prefix[:, None] & in_prefix[None, :])


_cached_block_causal = functools.lru_cache(maxsize=32)(_block_causal_mask)


def reference_attention(q, k, v, *, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(q kᵀ / √d) v in fp32, with key/value heads repeated for GQA. Slow; the ground truth."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is None:
        return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    probs = torch.where(mask.any(dim=-1, keepdim=True), probs, 0.0)  # a query that sees no key: zeros, not NaN
    return (probs @ v.float()).to(q.dtype)


@assume_constant_result
def auto_backend(device_type: str, device_index: int, dtype: torch.dtype, head_dim: int) -> str:
    """The fastest backend for these inputs; logged once per distinct decision. Runs eagerly under torch.compile."""
    choice, why = (
        "sdpa",
        "PyTorch picks its fused kernel per call: flash for causal, memory-efficient or cuDNN under a mask",
    )
    if device_type == "cuda":
        usable = [name for name in flash.PACKAGES if flash.usable(name, device_index, dtype, head_dim)]
        if usable:
            choice, why = usable[0], f"installed and supports this GPU, {dtype} and head_dim {head_dim}"
        else:
            why = f"no flash-attn package usable here ({flash.why_not(device_index, dtype, head_dim)}); {why}"
    log_once(f"attention backend: {choice} (auto on {device_type} {dtype} head_dim {head_dim}: {why})")
    return choice


# torch's flop counter has formulas for the CUDA fused attention kernels, not for the one SDPA runs on
# CPU; without these, a CPU run counts no attention at all. Dense S x S products, as for the others.
@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    batch, heads, queries, head_dim = query_shape
    return 2 * batch * heads * queries * key_shape[2] * (head_dim + value_shape[3])


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return 2 * _cpu_attention_flops(query_shape, key_shape, value_shape)
