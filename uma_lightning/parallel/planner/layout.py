"""A parallel layout (the mesh and how a step is cut into micro-batches) and the candidates for a cluster.

Ranks are laid out pp x dp_replicate x dp_shard x tp, tp innermost as in ``parallel/mesh.py``
(pipeline stages outermost, so only their point-to-point traffic crosses the slowest links).
Expert parallelism splits dp_shard: experts shard over ``ep`` of its ranks and the dense weights over all of it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from uma_lightning.parallel.apply import ActivationCheckpointing
from uma_lightning.parallel.planner.cluster import Cluster
from uma_lightning.parallel.planner.model import ModelFacts

AC_MODES: tuple[ActivationCheckpointing, ...] = ("none", "ops", "full")
MICROBATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (1, 2)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    ac: ActivationCheckpointing = "none"
    microbatches: int = 1  # pipeline micro-batches, or gradient accumulation without a pipeline
    virtual_stages: int = 1  # pipeline stages per rank (2: interleaved schedule)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in ("pp", "dp_replicate", "dp_shard", "ep", "tp") if getattr(self, name) > 1]
        mesh = " x ".join(parts) or "1 rank"
        steps = f"mb {self.microbatches}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return f"{mesh} | ac {self.ac} | {steps}"

    def strategy_name(self) -> str:
        data = "hsdp" if self.dp_replicate > 1 and self.dp_shard > 1 else "fsdp" if self.dp_shard > 1 else "ddp" if self.dp_replicate > 1 else ""
        parts = [p for p in ("pp" if self.pp > 1 else "", data, "ep" if self.ep > 1 else "", "tp" if self.tp > 1 else "") if p]
        return "_".join(parts) or "single"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(facts: ModelFacts, world_size: int) -> Iterator[Layout]:
    """Every layout of ``world_size`` ranks, legal or not (``illegal_reason`` says which are not)."""
    experts = facts.n_experts
    for tp, pp in itertools.product(divisors(world_size), divisors(world_size)):
        if world_size % (tp * pp):
            continue
        dp = world_size // (tp * pp)
        for dp_replicate in divisors(dp):
            dp_shard = dp // dp_replicate
            for ep in [e for e in divisors(dp_shard) if experts and experts % e == 0] or [1]:
                for ac, m in itertools.product(AC_MODES, MICROBATCHES):
                    for v in VIRTUAL_STAGES if pp > 1 else (1,):
                        yield Layout(dp_replicate, dp_shard, tp, pp, ep, ac, m, v)


@functools.lru_cache(maxsize=256)
def plan_refusal(facts: ModelFacts, tp: int) -> str | None:
    """What the model's own parallel plan says against splitting it over ``tp`` ranks (shapes that do not divide, layers it has no layout for)."""
    from uma_lightning.parallel.apply import ParallelConfig
    from uma_lightning.parallel.mesh import MeshShape
    from uma_lightning.parallel.plans import plan_for

    try:
        plan_for(facts.model).check(facts.model, MeshShape(1, 1, tp), ParallelConfig())
    except ValueError as err:
        return str(err)
    return None


def illegal_reason(layout: Layout, facts: ModelFacts, cluster: Cluster, global_batch: int) -> str | None:
    """Why ``layout`` cannot run this model on this cluster, in a few words, or None."""
    b = facts.cfg.backbone
    if layout.tp > cluster.gpus_per_node:
        return f"tp {layout.tp} crosses nodes ({cluster.gpus_per_node} GPUs per node)"
    if refused := plan_refusal(facts, layout.tp):
        return refused
    if global_batch % layout.dp:
        return f"global batch {global_batch} does not split over dp {layout.dp}"
    per_rank = global_batch // layout.dp
    if per_rank % layout.microbatches:
        return f"batch {per_rank} per data-parallel rank does not split into {layout.microbatches} micro-batches"
    if layout.pp > 1:
        stages = layout.pp * layout.virtual_stages
        if b.n_layers % stages:
            return f"{b.n_layers} layers do not divide into {stages} stages"
        if layout.microbatches < layout.pp:
            return f"{layout.microbatches} micro-batches, fewer than the {layout.pp} stages"
        if layout.virtual_stages > 1 and layout.microbatches % layout.pp:
            return f"interleaved schedule needs micro-batches ({layout.microbatches}) a multiple of pp {layout.pp}"
    return None
