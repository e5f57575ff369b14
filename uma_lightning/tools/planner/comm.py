"""Collectives of one training step under a layout: bytes, the links they cross, alpha-beta time.

Bytes are each collective's full buffer: the gathered tensor of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce, what one rank sends in an all-to-all or a
point-to-point. Times follow the ring algorithms: a group of n ranks moves (n - 1) / n of the
buffer through each rank's link (twice for an all-reduce) in n - 1 steps of latency alpha, at the
slowest link the group crosses.

Where they come from (``parallel/apply.py``, ``plans/robot.py``), per micro-batch:
- FSDP: each block's weights gathered before its forward and again before its backward (the root's
  once: it stays gathered), every unit's gradients reduce-scattered; HSDP all-reduces the shards
  across replicas after;
- DDP: every gradient all-reduced;
- TP of a network's tp_plan: its row-wise layers' outputs all-reduced in forward, its column-wise
  layers' input gradients in backward;
- TP: per block two all-gathers of the sequence-parallel activations and two reduce-scatters in
  forward, the same in backward, the backbone's output gathered and its input gradient gathered,
  and column-wise head weights gathered for the fused loss (with FSDP also the norms' gradients all-reduced);
- pipeline: one activation forward and its gradient backward per stage boundary;
- experts: per MoE layer a dispatch and a combine all-to-all, forward and backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from uma_lightning.tools.planner.cluster import Cluster, Link
from uma_lightning.tools.planner.layout import Layout
from uma_lightning.tools.planner.memory import Precision, padded_shape, stage_params, unit_elements
from uma_lightning.tools.planner.model import ModelFacts


@dataclass(frozen=True)
class Collective:
    what: str
    kind: str
    bytes: int  # per call
    calls: int  # per step
    group: int  # ranks in the group
    stride: int  # rank distance between group members
    overlaps_compute: bool  # FSDP's and DDP's run beside the next block's compute; TP's and experts' wait on it

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.calls


def crosses_nodes(group: int, stride: int, cluster: Cluster) -> bool:
    return group > 1 and group * stride > cluster.gpus_per_node


def link_of(collective: Collective, cluster: Cluster) -> Link:
    return cluster.inter if crosses_nodes(collective.group, collective.stride, cluster) else cluster.intra


def seconds(collective: Collective, cluster: Cluster) -> float:
    """Alpha-beta time of all the calls of ``collective``."""
    n, link = collective.group, link_of(collective, cluster)
    if n == 1:
        return 0.0
    if collective.kind == "p2p":
        traffic, hops = collective.bytes, 1
    else:
        passes = 2 if collective.kind == "all-reduce" else 1
        traffic, hops = passes * (n - 1) / n * collective.bytes, passes * (n - 1)
    return collective.calls * (traffic / (link.gb_s * 1e9) + hops * link.latency_us * 1e-6)


def step_collectives(
    facts: ModelFacts, layout: Layout, precision: Precision, global_batch: int, stage: int = 0
) -> list[Collective]:
    """The collectives of pipeline rank ``stage`` (every rank without a pipeline)."""
    m, tp = layout.microbatches, layout.tp
    batch = global_batch // layout.dp // m
    params = stage_params(facts, layout, stage)
    # Every weight is gathered; only the trainable ones have gradients to reduce.
    root, blocks = unit_elements(facts, layout, stage=stage)
    trained_root, trained_blocks = unit_elements(facts, layout, trainable_only=True, stage=stage)
    trained = trained_root + sum(trained_blocks)
    block_elements = sum(blocks)
    if layout.ep > 1 and layout.dp == layout.ep:
        # Experts split over every data-parallel rank have no copies to gather or gradients to reduce (measured).
        block_elements -= sum(math.prod(padded_shape(p, layout)) for p in params if p.expert)
        trained -= sum(math.prod(padded_shape(p, layout)) for p in params if p.expert and p.trainable)
    # A pipeline schedule reduces gradients once, after its last microbatch, and keeps the blocks
    # gathered from the first backward to the last and its root from the first forward (measured);
    # accumulation without a pipeline repeats a whole step per microbatch.
    once_per_step = layout.pp > 1
    syncs = 1 if once_per_step else m
    out: list[Collective] = []
    shard_stride, replicate_stride = tp, tp * layout.dp_shard
    if layout.dp_shard > 1:
        cb = precision.compute_bytes
        if once_per_step:
            out.append(Collective("FSDP root weights", "all-gather", root * cb, 1, layout.dp_shard, shard_stride, True))
            out.append(
                Collective(
                    "FSDP block weights, forward",
                    "all-gather",
                    block_elements * cb,
                    m,
                    layout.dp_shard,
                    shard_stride,
                    True,
                )
            )
        else:
            out.append(
                Collective(
                    "FSDP weights, forward",
                    "all-gather",
                    (root + block_elements) * cb,
                    m,
                    layout.dp_shard,
                    shard_stride,
                    True,
                )
            )
        out.append(
            Collective(
                "FSDP weights, backward", "all-gather", block_elements * cb, syncs, layout.dp_shard, shard_stride, True
            )
        )
        out.append(
            Collective(
                "FSDP gradients",
                "reduce-scatter",
                trained * precision.reduce_bytes,
                syncs,
                layout.dp_shard,
                shard_stride,
                True,
            )
        )
        if layout.dp_replicate > 1:
            shards = trained // layout.dp_shard * precision.reduce_bytes
            out.append(
                Collective(
                    "HSDP gradient shards", "all-reduce", shards, syncs, layout.dp_replicate, replicate_stride, True
                )
            )
    elif layout.dp_replicate > 1:
        out.append(
            Collective(
                "DDP gradients",
                "all-reduce",
                trained * precision.reduce_bytes,
                syncs,
                layout.dp_replicate,
                replicate_stride,
                True,
            )
        )
    if tp > 1 and not facts.cfg:
        # A tp_plan's layers: each row-wise one's partial outputs summed in the forward, each column-wise
        # one's partial input gradients in the backward (``parallel/plans/generic.py``).
        forward, backward = facts.tp_exchange
        cb = precision.compute_bytes
        out.append(Collective("TP row-wise outputs", "all-reduce", batch * forward * cb, m, tp, 1, False))
        out.append(Collective("TP column-wise input gradients", "all-reduce", batch * backward * cb, m, tp, 1, False))
    elif tp > 1:
        activation = batch * facts.cfg.seq_len * facts.cfg.backbone.dim * precision.compute_bytes
        layers = facts.n_layers // layout.pp
        # A MoE layer routes each rank's own slice of the sequence: no gather and scatter around it
        # (forward and backward), but its whole weights' gradients are summed over tp.
        moe_layers = _moe_layers(facts) // layout.pp
        out.append(
            Collective("TP activations", "all-gather", activation, m * (4 * layers - 2 * moe_layers + 2), tp, 1, False)
        )
        out.append(
            Collective("TP activations", "reduce-scatter", activation, m * (4 * layers - 2 * moe_layers), tp, 1, False)
        )
        moe_weights = sum(
            math.prod(p.shape)
            for p in params
            if ".ffn." in p.name and p.layer in _moe_layer_indices(facts) and p.trainable
        )
        if moe_weights:
            out.append(
                Collective(
                    "TP MoE layer gradients", "all-reduce", moe_weights * precision.compute_bytes, m, tp, 1, False
                )
            )
        if layout.dp_shard > 1:
            # Measured: with FSDP over the tensor-parallel weights, the sequence-parallel norms' partial
            # gradients are all-reduced over tp (without FSDP they are not).
            norms = sum(math.prod(p.shape) for p in params if p.name.endswith("norm.weight"))
            out.append(Collective("TP norm gradients", "all-reduce", norms * precision.reduce_bytes, m, tp, 1, False))
        heads = sum(math.prod(p.shape) for p in params if p.tp_dim is not None and p.unit == -1)
        if heads:
            out.append(Collective("TP head weights", "all-gather", heads * precision.compute_bytes, m, tp, 1, False))
    if layout.pp > 1:
        boundary = batch * facts.cfg.seq_len // tp * facts.cfg.backbone.dim * precision.compute_bytes
        # Each of the rank's stage modules sends its output and receives its input's gradient at a
        # boundary after it, receives its input and sends that gradient at one before it.
        stages = layout.pipeline_config().stage_indices(layout.pp, stage)
        boundaries = 2 * len(stages) - (0 in stages) - (layout.pp * layout.virtual_stages - 1 in stages)
        out.append(
            Collective(
                "pipeline activations and their gradients",
                "p2p",
                boundary,
                2 * m * boundaries,
                2,
                stage_stride(layout),
                True,
            )
        )
        # The step's bubble share, averaged over the stages (``Pipeline.step``): one float64.
        out.append(Collective("pipeline bubble figure", "all-reduce", 8, 1, layout.pp, stage_stride(layout), True))
    if layout.ep > 1:
        moe = facts.cfg.backbone.moe
        moe_layers = _moe_layers(facts) // layout.pp
        routed = batch * facts.cfg.seq_len * moe.top_k * facts.cfg.backbone.dim * precision.compute_bytes
        out.append(
            Collective("expert dispatch and combine", "all-to-all", routed, 4 * m * moe_layers, layout.ep, tp, False)
        )
    return out


def _moe_layer_indices(facts: ModelFacts) -> set[int]:
    backbone = facts.cfg.backbone
    return {index for index in range(facts.n_layers) if backbone.moe is not None and backbone.is_moe_layer(index)}


def _moe_layers(facts: ModelFacts) -> int:
    return len(_moe_layer_indices(facts))


def stage_stride(layout: Layout) -> int:
    """Rank distance between neighbouring pipeline stages (pp is the outermost mesh dimension)."""
    return layout.dp * layout.tp
