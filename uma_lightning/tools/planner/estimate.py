"""One layout's estimate (memory, time, throughput) and the ranking of every candidate.

Step time = compute / (1 - bubble) + the communication compute cannot hide. Compute is the
model's exact training FLOPs (``models/flops.py``; full activation checkpointing adds one more
forward of the blocks) over the cluster's peak at an achievable fraction ``mfu``. FSDP's and DDP's
collectives run beside compute and show only where they take longer; TP's and the experts'
all-to-alls sit on the critical path. The pipeline bubble is (p - 1) / (m + p - 1), and
(p - 1) / (v m + p - 1) with v virtual stages per rank.

A checkpoint holds the parameters and AdamW state once: DCP writes a shard that data-parallel
replicas share only once, spreading such writes over the replicas. The ranks of a node write to the
node's storage together, the nodes at the same time, so a save takes a node's bytes over the node's
disk bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from uma_lightning.tools.planner.cluster import GIB, Cluster
from uma_lightning.tools.planner.comm import Collective, seconds, step_collectives
from uma_lightning.tools.planner.layout import AC_MODES, Layout, candidates, illegal_reason
from uma_lightning.tools.planner.memory import (
    Precision,
    StateBytes,
    activation_bytes,
    buffer_bytes,
    largest_state,
)
from uma_lightning.tools.planner.model import ModelFacts

# Of a device's memory, what training may use: the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation take the rest.
USABLE_MEMORY = 0.92


@dataclass(frozen=True)
class Settings:
    global_batch: int
    precision: Precision
    mfu: float  # achievable fraction of peak FLOP/s for the model's matmuls


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, int] = field(default_factory=dict)  # bytes per rank, by part
    collectives: list[Collective] = field(default_factory=list)
    compute_s: float = 0.0
    bubble: float = 0.0
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    throughput: float = 0.0  # per second, in ``unit``
    unit: str = "tokens"  # what ``throughput`` counts: tokens, or samples for a network without tokens
    checkpoint_bytes: int = 0  # of the rank holding the most
    save_s: float = 0.0
    rejected: str | None = None

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values())


def pipeline_bubble(layout: Layout) -> float:
    if layout.pp == 1:
        return 0.0
    return (layout.pp - 1) / (layout.virtual_stages * layout.microbatches + layout.pp - 1)


def compute_seconds(facts: ModelFacts, layout: Layout, cluster: Cluster, settings: Settings) -> float:
    flops = facts.flops_per_sample + (facts.block_forward_flops_per_sample if layout.ac == "full" else 0)
    return flops * settings.global_batch / (cluster.world_size * cluster.peak_tflops * 1e12 * settings.mfu)


def checkpoint_bytes(state: StateBytes) -> int:
    return state.params + state.optimizer  # gradients are not saved


def save_seconds(largest_rank_bytes: int, replicas: int, cluster: Cluster) -> float:
    """Time to write a checkpoint whose largest rank holds ``largest_rank_bytes`` in each of ``replicas``
    identical copies (an upper bound when ranks differ, as pipeline stages do)."""
    return cluster.gpus_per_node * largest_rank_bytes / replicas / (cluster.disk_gb_s * 1e9)


def estimate(facts: ModelFacts, layout: Layout, cluster: Cluster, settings: Settings) -> Estimate:
    result = Estimate(layout)
    result.rejected = illegal_reason(layout, facts, cluster, settings.global_batch)
    if result.rejected:
        return result
    state = largest_state(facts, layout, settings.precision)
    result.memory = {
        "parameters": state.params,
        "gradients": state.grads,
        "optimizer": state.optimizer,
        "activations": activation_bytes(facts, layout, settings.precision, settings.global_batch),
        "buffers": buffer_bytes(facts, layout, settings.precision),
    }
    result.checkpoint_bytes = checkpoint_bytes(state)
    result.save_s = save_seconds(result.checkpoint_bytes, layout.dp_replicate, cluster)
    usable = cluster.memory_gib * USABLE_MEMORY
    if result.peak_bytes > usable * GIB:
        result.rejected = f"needs {result.peak_bytes / GIB:.1f} GiB per GPU, has {usable:.1f}"
    result.collectives = step_collectives(facts, layout, settings.precision, settings.global_batch)
    result.compute_s = compute_seconds(facts, layout, cluster, settings)
    result.bubble = pipeline_bubble(layout)
    hidden = sum(seconds(c, cluster) for c in result.collectives if c.overlaps_compute)
    exposed = sum(seconds(c, cluster) for c in result.collectives if not c.overlaps_compute)
    result.exposed_comm_s = exposed + max(0.0, hidden - result.compute_s)
    result.step_s = result.compute_s / (1 - result.bubble) + result.exposed_comm_s
    result.unit = facts.throughput_unit
    result.throughput = settings.global_batch * (facts.tokens_per_sample or 1) / result.step_s
    return result


_AC_COST = {mode: cost for cost, mode in enumerate(AC_MODES)}


def rank(facts: ModelFacts, cluster: Cluster, settings: Settings) -> tuple[list[Estimate], list[Estimate]]:
    """(Layouts that fit, fastest first; layouts that do not, each with its reason)."""
    fits, rejected = [], []
    for layout in candidates(facts, cluster.world_size):
        result = estimate(facts, layout, cluster, settings)
        (rejected if result.rejected else fits).append(result)
    # Equal throughput: the simpler layout (less recomputation, fewer micro-batches, less memory).
    fits.sort(key=lambda e: (-round(e.throughput, 6), _AC_COST[e.layout.ac], e.layout.microbatches, e.peak_bytes))
    return fits, rejected
