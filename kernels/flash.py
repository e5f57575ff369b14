"""FlashAttention packages behind the attention entry point: flash-attn 2 and FlashAttention-4 (CuTe).

Both take [B, S, H, D] tensors, grouped-query heads, and a causal flag that, when queries are
fewer than keys, aligns the diagonal to the bottom right: query i of S_q sees keys up to
i + S_k - S_q. That gives the masks the models need without materialising one:

- block-causal with prefix P: prefix queries attend the prefix keys without a mask, and the
  remaining queries attend all keys causally (bottom-right aligned), in a second call;
- padding: real tokens are packed into one sequence per sample for the variable-length call,
  whose outputs are scattered back (padded positions stay zero).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# backend name -> (module, install hint, minimum compute capability, head dims it runs)
PACKAGES = {
    "flash_attn_4": ("flash_attn.cute", "pip install 'uma-lightning[flash4]'", (9, 0), (64, 96, 128)),
    "flash_attn": ("flash_attn", "pip install 'uma-lightning[flash]'", (8, 0), tuple(range(8, 257, 8))),
}
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashFunctions:
    """A package's fixed-length and variable-length entry points (called with keyword arguments)."""

    func: Callable
    varlen_func: Callable


@functools.cache
def load(name: str) -> FlashFunctions:
    module_name = PACKAGES[name][0]
    try:
        module = importlib.import_module(module_name)
        return FlashFunctions(func=module.flash_attn_func, varlen_func=module.flash_attn_varlen_func)
    except (ImportError, AttributeError):
        raise RuntimeError(install_hint(name)) from None


def install_hint(name: str) -> str:
    return f"attention backend {name!r} is not installed: {PACKAGES[name][1]}"


def check_inputs(name: str, q: torch.Tensor) -> None:
    _, _, capability, head_dims = PACKAGES[name]
    if q.device.type != "cuda":
        raise RuntimeError(f"attention backend {name!r} needs a CUDA GPU, got a {q.device.type} tensor")
    if q.dtype not in HALF_DTYPES:
        raise RuntimeError(
            f"attention backend {name!r} supports float16 and bfloat16, got {q.dtype} (train with precision bf16-mixed)"
        )
    if q.shape[-1] not in head_dims:
        raise RuntimeError(f"attention backend {name!r} does not support head_dim {q.shape[-1]}")
    if torch.cuda.get_device_capability(q.device) < capability:
        raise RuntimeError(f"attention backend {name!r} needs compute capability {capability} or newer")


def usable(name: str, device_index: int, dtype: torch.dtype, head_dim: int) -> bool:
    module_name, _, capability, head_dims = PACKAGES[name]
    if dtype not in HALF_DTYPES or head_dim not in head_dims:
        return False
    if torch.cuda.get_device_capability(max(device_index, 0)) < capability:
        return False
    return installed(name)


def installed(name: str) -> bool:
    try:
        load(name)
    except RuntimeError:
        return False
    return True


def why_not(device_index: int, dtype: torch.dtype, head_dim: int) -> str:
    if dtype not in HALF_DTYPES:
        return f"they need float16 or bfloat16, not {dtype}"
    missing = [name for name in PACKAGES if not installed(name)]
    if len(missing) == len(PACKAGES):
        return f"not installed: {', '.join(missing)}"
    return f"head_dim {head_dim} or compute capability {torch.cuda.get_device_capability(max(device_index, 0))} unsupported"


def flash_attention(
    q, k, v, *, causal: bool, prefix_len: int, key_padding_mask: torch.Tensor | None, functions: FlashFunctions
) -> torch.Tensor:
    """Attention with the masks of ``uma_lightning.kernels.attention``, on [B, H, S, D] tensors."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D], contiguous for projections viewed as heads
    block_causal = causal and 1 < prefix_len < q.shape[1]
    causal = causal and prefix_len < q.shape[1]  # a prefix spanning every token means no causal part
    if key_padding_mask is not None:
        out = _padded(
            q,
            k,
            v,
            key_padding_mask.to(torch.bool),
            causal=causal,
            prefix_len=prefix_len if block_causal else 0,
            functions=functions,
        )
    elif block_causal:
        prefix = _call(functions.func, q[:, :prefix_len], k[:, :prefix_len], v[:, :prefix_len], causal=False)
        rest = _call(functions.func, q[:, prefix_len:], k, v, causal=True)
        out = torch.cat((prefix, rest), dim=1)
    else:
        out = _call(functions.func, q, k, v, causal=causal)
    return out.transpose(1, 2)


def _padded(q, k, v, mask: torch.Tensor, *, causal: bool, prefix_len: int, functions: FlashFunctions) -> torch.Tensor:
    batch, seq = mask.shape
    real = mask.flatten().nonzero().squeeze(1)
    packed = [t.flatten(0, 1).index_select(0, real) for t in (q, k, v)]  # [T, H, D], samples one after another
    lengths = mask.sum(dim=1, dtype=torch.int32)
    if prefix_len == 0:
        out = _varlen(functions, *packed, lengths, lengths, causal=causal)
    else:
        # Packing keeps each sample's order, so its real prefix tokens come first.
        in_prefix = (torch.arange(seq, device=mask.device) < prefix_len).expand(batch, seq).flatten()[real]
        prefix_rows, rest_rows = in_prefix.nonzero().squeeze(1), (~in_prefix).nonzero().squeeze(1)
        prefix_lengths = mask[:, :prefix_len].sum(dim=1, dtype=torch.int32)
        pq, pk, pv = (t.index_select(0, prefix_rows) for t in packed)
        prefix = _varlen(functions, pq, pk, pv, prefix_lengths, prefix_lengths, causal=False)
        rest = _varlen(
            functions,
            packed[0].index_select(0, rest_rows),
            packed[1],
            packed[2],
            lengths - prefix_lengths,
            lengths,
            causal=True,
        )
        out = torch.zeros_like(packed[0]).index_copy(0, prefix_rows, prefix).index_copy(0, rest_rows, rest)
    full = q.new_zeros(batch * seq, *q.shape[2:]).index_copy(0, real, out)
    return full.view(batch, seq, *q.shape[2:])


def _varlen(
    functions: FlashFunctions, q, k, v, q_lengths: torch.Tensor, k_lengths: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    if q.shape[0] == 0:
        return q
    cu_q = F.pad(q_lengths.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(k_lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return _call(
        functions.varlen_func,
        q,
        k,
        v,
        causal=causal,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(q_lengths.max()),
        max_seqlen_k=int(k_lengths.max()),
    )


def _call(function: Callable, q, k, v, **kwargs) -> torch.Tensor:
    out = function(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # FlashAttention-4 returns (out, lse)
