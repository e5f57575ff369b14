"""The one attention entry point every model calls.

Tensors use the SDPA layout: q [B, H, S, D], k and v [B, H_kv, S, D] with H % H_kv == 0
(grouped-query attention). The mask is described, not materialised, by the caller:

- ``causal=False``: every token sees every token;
- ``causal=True, prefix_len=0``: plain causal;
- ``causal=True, prefix_len=P``: block-causal, as pi0-style policies use. Tokens [0, P) (language,
  images, state) see each other bidirectionally; later tokens (actions) see the whole prefix and
  earlier actions only.
- ``key_padding_mask`` [B, S], True where a key is real, hides padding (e.g. short instructions).

Backends: ``sdpa`` (PyTorch scaled_dot_product_attention, which picks its own fused kernel) and
``reference`` (plain matmul-softmax-matmul, the ground truth for tests). ``auto`` picks the
fastest available and logs the choice once.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "reference")


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
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if backend == "auto":
        backend = _auto_backend(q.device.type)
    mask = build_mask(q.shape[2], causal=causal, prefix_len=prefix_len, key_padding_mask=key_padding_mask, device=q.device)
    if backend == "reference":
        return reference_attention(q, k, v, mask=mask, causal=causal)
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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


@functools.lru_cache(maxsize=32)
def _block_causal(seq_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(seq_len, device=device)
    causal = idx[:, None] >= idx[None, :]
    in_prefix = idx < prefix_len
    return causal | (in_prefix[:, None] & in_prefix[None, :])


def reference_attention(q, k, v, *, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(q kᵀ / √d) v in fp32, with key/value heads repeated for GQA. Slow; the ground truth."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


@functools.lru_cache(maxsize=None)
def _auto_backend(device_type: str) -> str:
    choice = "sdpa"
    log.info("attention backend: %s (auto on %s: PyTorch SDPA picks its fused kernel per call)", choice, device_type)
    return choice
