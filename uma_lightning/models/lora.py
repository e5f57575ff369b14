"""LoRA: trainable low-rank updates on chosen linear layers, the rest of the weights left as they are.

A wrapped layer computes ``x Wᵀ + b + (alpha / rank) · x Aᵀ Bᵀ`` with A [rank, in] and B [out, rank].
B starts at zero, so adding adapters does not change the model's outputs. The layer keeps W under
its old name (``weight``), so checkpoints without adapters load into a model with them; the adapters
add ``lora_a`` and ``lora_b``. ``merge_lora`` folds the updates into W for export.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoraConfig:
    """LoRA adapters on the linear layers whose names match ``targets`` (glob patterns).

    Args:
        targets: Glob patterns of linear layers' names, e.g. ``backbone.layers.*.attn.wq``.
        rank: Rank of each adapter's two factors.
        alpha: The adapter's output is scaled by alpha / rank.
    """

    targets: list[str] = field(default_factory=list)
    rank: int = 8
    alpha: float = 16.0


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same parameters, not copies
        self.rank, self.scale = rank, alpha / rank
        # Where the network is built: a pretrained model's weights wait on the meta device to be
        # loaded, but the adapters start from their own initialisation.
        device = torch.empty(0).device if base.weight.is_meta else base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear initialises its weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged(self) -> nn.Linear:
        """A plain linear layer computing the same function."""
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.weight + self.scale * self.lora_b @ self.lora_a)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def add_lora(model: nn.Module, targets: list[str], rank: int = 8, alpha: float = 16.0) -> list[str]:
    """Wrap every ``nn.Linear`` whose name matches one of the glob patterns in ``targets``
    (e.g. ``backbone.layers.*.attn.wq``); their own weights stop training. Returns the wrapped names.

    A pattern that matches no linear layer is an error naming it, so a typo never silently trains nothing.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    linears = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    unmatched = [pattern for pattern in targets if not fnmatch.filter(linears, pattern)]
    if unmatched:
        example = next(iter(linears), "none")
        raise ValueError(f"LoRA target(s) {unmatched} match no linear layer (names look like {example!r})")
    wrapped = sorted(name for name in linears if any(fnmatch.fnmatchcase(name, pattern) for pattern in targets))
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoRALinear(linears[name], rank, alpha)
        layer.weight.requires_grad_(False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        setattr(parent, child, layer)
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Replace every LoRA layer by a plain linear layer with its update folded in; returns how many."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.merged())
    return len(layers)
