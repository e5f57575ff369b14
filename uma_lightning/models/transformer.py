"""Decoder-only transformer backbone: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Pure PyTorch, no distributed code: parallel plans in ``uma_lightning.parallel`` wrap it from the
outside. The backbone maps token embeddings [B, S, dim] to hidden states [B, S, dim]; the
modality tokenizers and heads around it live in ``robot.py``. Norms, rotary, the SwiGLU gate and
attention call ``uma_lightning.kernels``; ``set_kernels`` picks their implementations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from uma_lightning.kernels import KernelConfig, apply_rotary, attention, rms_norm, swiglu
from uma_lightning.models.moe import GroupedExperts, MoEConfig, MoEFeedForward


@dataclass(frozen=True)
class TransformerConfig:
    """Backbone dimensions; the size presets in ``configs/model/`` fill these in.

    Args:
        dim: Width of the residual stream.
        n_layers: Transformer blocks.
        n_heads: Attention query heads.
        n_kv_heads: Key/value heads (fewer than n_heads: grouped-query attention).
        ffn_dim: Hidden size of each SwiGLU feed-forward.
        norm_eps: Epsilon of the RMS norms.
        rope_theta: Base of the rotary position embedding's frequencies.
        name: The preset's name, shown in logs and run names.
        moe: A mixture-of-experts feed-forward in some layers (see ``MoEConfig``); empty: dense everywhere.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    name: str = "custom"
    moe: Optional[MoEConfig] = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, Mapping):  # from a YAML preset or saved hyperparameters
            unknown = sorted(set(self.moe) - {f.name for f in dataclasses.fields(MoEConfig)})
            if unknown:
                raise ValueError(
                    f"model size: unknown moe key(s) {unknown}; known keys: {[f.name for f in dataclasses.fields(MoEConfig)]}"
                )
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = KernelConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.kernels.rms_norm)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim // 2] for positions 0..seq_len-1."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


@dataclass
class LayerKV:
    """Keys and values [B, n_kv_heads, length, head_dim] one layer computed for the tokens seen so far."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


@dataclass
class KVCache:
    """What a backbone computed for tokens it has already seen, so later tokens attend to them without
    recomputing them: autoregressive decoding, or the denoising steps of a flow-matching action expert,
    which all attend to one observation prefix.

    Pass an empty cache to ``Transformer.forward`` with the prefix to fill it; pass it again with new
    tokens only. New tokens see every cached token and each other (one decoded token, or a whole action
    chunk denoised as a block), and are appended. ``copy()`` gives a cache to extend while this one
    stays as it is, without copying tensors.
    """

    layers: list[LayerKV]
    key_padding_mask: torch.Tensor | None = None  # [B, length], True on real tokens

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([LayerKV() for _ in range(n_layers)])

    @property
    def length(self) -> int:
        return 0 if self.key_padding_mask is None else self.key_padding_mask.shape[1]

    def copy(self) -> KVCache:
        return KVCache([LayerKV(kv.keys, kv.values) for kv in self.layers], self.key_padding_mask)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.kernels = KernelConfig()

    def forward(
        self, x, cos, sin, *, prefix_len: int, key_padding_mask: torch.Tensor | None, cache: LayerKV | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output; with a cache, (it, the keys and values of the cache's tokens and these). The
        cache is read, never changed: a block recomputed in backward (activation checkpointing)
        must see the keys its forward saw, so the caller extends the cache."""
        batch, seq, _ = x.shape
        # -1 rather than the configured head count: tensor parallelism shards heads across ranks.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = (
            apply_rotary(q, cos, sin, backend=self.kernels.rotary),
            apply_rotary(k, cos, sin, backend=self.kernels.rotary),
        )
        if cache is not None and cache.keys is not None:
            k, v = torch.cat((cache.keys, k), dim=2), torch.cat((cache.values, v), dim=2)
            # Fewer queries than keys: SDPA takes that; the flash paths expect one length for both.
            backend = "reference" if self.kernels.attention == "reference" else "sdpa"
            out = attention(q, k, v, causal=False, key_padding_mask=key_padding_mask, backend=backend)
        else:
            out = attention(
                q,
                k,
                v,
                causal=True,
                prefix_len=prefix_len,
                key_padding_mask=key_padding_mask,
                backend=self.kernels.attention,
            )
        out = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return out if cache is None else (out, k, v)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.kernels = KernelConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), backend=self.kernels.swiglu))


def build_feed_forward(cfg: TransformerConfig, index: int) -> nn.Module:
    """Layer ``index``'s feed-forward: dense SwiGLU, or experts where ``cfg.moe`` places them."""
    if not cfg.is_moe_layer(index):
        return FeedForward(cfg.dim, cfg.ffn_dim)
    hidden = cfg.moe.hidden(cfg.ffn_dim)
    shared = FeedForward(cfg.dim, cfg.moe.n_shared * hidden) if cfg.moe.n_shared else None
    return MoEFeedForward(cfg.dim, hidden, cfg.moe, shared)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = build_feed_forward(cfg, index)

    def forward(
        self, x, cos, sin, *, prefix_len: int, key_padding_mask: torch.Tensor | None, cache: LayerKV | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new hidden states; with a cache (read, not changed), (them, the keys, the values): the
        cache's and these tokens', which the caller stores in the cache. They leave as outputs, so a
        wrapper that hooks a block's outputs (to gather its weights again for backward) sees the
        gradients that come back through them."""
        attended = self.attn(
            self.attn_norm(x), cos, sin, prefix_len=prefix_len, key_padding_mask=key_padding_mask, cache=cache
        )
        if cache is not None:
            attended, keys, values = attended
        x = x + attended
        x = x + self.ffn(self.ffn_norm(x))
        return x if cache is None else (x, keys, values)


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.layers = nn.ModuleList(Block(cfg, index) for index in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Not persistent: derived from the config, so checkpoints carry weights only.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    def set_kernels(self, kernels: KernelConfig) -> None:
        """Use these implementations for attention, norms, rotary and SwiGLU from the next forward on."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, FeedForward, GroupedExperts)):
                module.kernels = kernels

    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place; also used after meta-device construction."""
        cos, sin = rotary_tables(
            self.max_seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=self.norm.weight.device
        )
        self.rope_cos, self.rope_sin = cos, sin
        # Residual projections are scaled down with depth so the residual stream's variance stays flat.
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for layer in self.layers:
            dense = isinstance(layer.ffn, FeedForward)
            for linear in (
                layer.attn.wq,
                layer.attn.wk,
                layer.attn.wv,
                *((layer.ffn.w1, layer.ffn.w3) if dense else ()),
            ):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (layer.attn.wo, *((layer.ffn.w2,) if dense else ())):
                nn.init.trunc_normal_(linear.weight, std=out_std)
            if not dense:
                layer.ffn.init_weights(0.02, out_std)
            layer.attn_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()

    def forward(
        self,
        h: torch.Tensor,
        *,
        prefix_len: int = 0,
        key_padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, S, dim] of token embeddings h [B, S, dim].

        Without a cache, or with an empty one (which this call fills), tokens [0, prefix_len) see each
        other and later tokens are causal. With a filled cache, h holds new tokens at positions
        cache.length onwards, and ``key_padding_mask`` (if given) covers only them.
        """
        start = 0 if cache is None else cache.length
        if start + h.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence of {start + h.shape[1]} tokens exceeds max_seq_len={self.max_seq_len}")
        # Tables from the first new position on, whole: under sequence parallelism h holds only this
        # rank's slice of the tokens, and attention sees them all after its all-gather.
        cos, sin = self.rope_cos[start:], self.rope_sin[start:]
        layer_caches = [None] * len(self.layers)
        if cache is not None:
            if len(cache.layers) != len(self.layers):
                raise ValueError(f"cache of {len(cache.layers)} layers given to a backbone of {len(self.layers)}")
            new = (
                key_padding_mask
                if key_padding_mask is not None
                else torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
            )
            key_padding_mask = new if start == 0 else torch.cat((cache.key_padding_mask, new), dim=1)
            cache.key_padding_mask = key_padding_mask
            layer_caches = cache.layers
        for layer, layer_cache in zip(self.layers, layer_caches):
            if layer_cache is None:
                h = layer(h, cos, sin, prefix_len=prefix_len, key_padding_mask=key_padding_mask)
                continue
            # The block gets a snapshot of the cache, which it only reads; the cache is extended here.
            past = LayerKV(layer_cache.keys, layer_cache.values)
            h, layer_cache.keys, layer_cache.values = layer(
                h, cos, sin, prefix_len=prefix_len, key_padding_mask=key_padding_mask, cache=past
            )
        return self.norm(h)
