"""Per-layer statistics of mixture-of-experts layers (tokens per expert, ...) summed over the ranks
that hold each layer, for every MoE layer of the model, on every rank.

Without pipeline parallelism every rank holds every layer and sees its own samples (MoE layers
take no tensor parallelism): a layer's sum is over all ranks. Under pp a rank holds only its
stages' layers, and the layers of another stage are other layers: each rank writes its layers'
rows into a table of every MoE layer of the model, zeros elsewhere, and one sum over all ranks
leaves in each layer's row the sum over the data-parallel ranks of its stage (adding zeros is
exact). Every rank, also one whose stages hold no MoE layer, so gets every layer's sums, and rank
0, which logs, those of the last stage too.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from uma_lightning.models.moe import moe_layers


def moe_layer_sizes(module: nn.Module) -> dict[str, int]:
    """Every MoE layer of ``module``, by name, with its number of experts: also those that pipeline
    stages on other ranks hold (the pipeline plan lists them before dropping them)."""
    for name, child in module.named_modules():
        pipeline = getattr(child, "pipeline", None)
        if pipeline is not None:
            return {f"{name}.{layer}" if name else layer: n_experts for layer, n_experts in pipeline.moe_layers.items()}
    return {name: layer.cfg.n_experts for name, layer in moe_layers(module)}


def sum_per_moe_layer(
    rows: dict[str, Tensor], module: nn.Module, strategy, extra_columns: int = 0
) -> dict[str, Tensor]:
    """``rows`` (this rank's MoE layers: a row of n_experts + ``extra_columns`` numbers each) summed
    over the ranks that hold each layer, for every MoE layer of ``module``, as float64. A collective:
    call it on every rank of a model with MoE layers anywhere (without any, it returns {} at once)."""
    sizes = moe_layer_sizes(module)
    if not sizes:
        return {}
    widths = [n_experts + extra_columns for n_experts in sizes.values()]
    layout = list(zip(sizes, itertools.accumulate(widths, initial=0), widths))
    table = torch.zeros(sum(widths), dtype=torch.float64, device=strategy.root_device)
    for name, start, width in layout:
        if name in rows:
            table[start : start + width] = rows[name].to(table)
    table = strategy.reduce(table, reduce_op="sum")
    return {name: table[start : start + width].cpu() for name, start, width in layout}
