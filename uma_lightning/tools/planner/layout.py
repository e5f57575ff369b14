"""A parallel layout (the mesh and how a step is cut into micro-batches) and the candidates for a cluster.

Ranks are laid out pp x dp_replicate x dp_shard x tp, tp innermost as in ``parallel/mesh.py``
(pipeline stages outermost, so only their point-to-point traffic crosses the slowest links).
Expert parallelism splits the data-parallel dimension as the mesh does: dp_shard (experts split over
``ep`` of its ranks, sharded over the rest) or, with dp_shard 1, dp_replicate.

Whether a layout can run is asked of the strategy's own checks (``strategy_refusal``), so the
planner recommends nothing ``uma fit`` refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from uma_lightning.parallel.apply import ActivationCheckpointing
from uma_lightning.parallel.mesh import MeshShape
from uma_lightning.tools.planner.cluster import Cluster
from uma_lightning.tools.planner.model import ModelFacts

# wrapping.activation_checkpointing's modes, from the least recomputation to the most.
AC_MODES: tuple[ActivationCheckpointing, ...] = ("none", "ops", "full")
MICROBATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (1, 2)


@dataclass(frozen=True)
class Layout(MeshShape):
    """A mesh shape (the sizes a strategy takes; every size 1 unless given) and how a step runs on it."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ac: ActivationCheckpointing = "none"
    microbatches: int = 1  # pipeline micro-batches, or gradient accumulation without a pipeline
    virtual_stages: int = 1  # pipeline stages per rank (2: interleaved schedule)

    @property
    def schedule(self) -> str:
        """The pipeline schedule: the ones whose bubble and in-flight microbatches the planner models."""
        return "Interleaved1F1B" if self.virtual_stages > 1 else "1F1B"

    def pipeline_config(self):
        from uma_lightning.parallel.pipeline import PipelineConfig

        return PipelineConfig(self.schedule, self.microbatches, self.virtual_stages)

    def sizes(self):
        """The ``sizes`` section of MeshStrategy that asks for this mesh."""
        from uma_lightning.parallel.mesh import MeshSizes

        return MeshSizes(**{field.name: getattr(self, field.name) for field in dataclasses.fields(MeshSizes)})

    def describe(self) -> str:
        parts = [
            f"{name} {getattr(self, name)}"
            for name in ("pp", "dp_replicate", "dp_shard", "ep", "tp")
            if getattr(self, name) > 1
        ]
        mesh = " x ".join(parts) or "1 rank"
        steps = f"mb {self.microbatches}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return f"{mesh} | ac {self.ac} | {steps}"

    def strategy_name(self) -> str:
        data = (
            "hsdp"
            if self.dp_replicate > 1 and self.dp_shard > 1
            else "fsdp"
            if self.dp_shard > 1
            else "ddp"
            if self.dp_replicate > 1
            else ""
        )
        parts = [
            p
            for p in ("pp" if self.pp > 1 else "", data, "ep" if self.ep > 1 else "", "tp" if self.tp > 1 else "")
            if p
        ]
        return "_".join(parts) or "single"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(facts: ModelFacts, world_size: int) -> Iterator[Layout]:
    """Every layout of ``world_size`` ranks, legal or not (``illegal_reason`` says which are not). A
    network outside the robot family is sized for the data-parallel strategies and its tp_plan
    without activation checkpointing or a pipeline: its traced step says what it saves, not what a
    layout of its blocks would."""
    for tp, pp in itertools.product(divisors(world_size), divisors(world_size) if facts.cfg else [1]):
        if world_size % (tp * pp):
            continue
        dp = world_size // (tp * pp)
        for dp_replicate in divisors(dp):
            dp_shard = dp // dp_replicate
            # ep is carved out of dp_shard, or of dp_replicate where dp_shard is 1 (mesh.py).
            for ep in divisors(dp_shard if dp_shard > 1 else dp_replicate) if facts.n_experts else [1]:
                for ac, m in itertools.product(AC_MODES if facts.cfg else ("none",), MICROBATCHES):
                    for v in VIRTUAL_STAGES if pp > 1 else (1,):
                        yield Layout(dp_replicate, dp_shard, tp, pp, ep, ac, m, v)


def illegal_reason(layout: Layout, facts: ModelFacts, cluster: Cluster, global_batch: int) -> str | None:
    """Why ``layout`` cannot run this model on this cluster, or None."""
    if layout.tp > cluster.gpus_per_node:
        return f"tp {layout.tp} crosses nodes ({cluster.gpus_per_node} GPUs per node)"
    if global_batch % layout.dp:
        return f"global batch {global_batch} does not split over dp {layout.dp}"
    per_rank = global_batch // layout.dp
    if layout.pp == 1 and per_rank % layout.microbatches:
        return f"batch {per_rank} per data-parallel rank does not split into {layout.microbatches} accumulated micro-batches"
    return strategy_refusal(facts, dataclasses.replace(layout, ac="none"), cluster.gpus_per_node, per_rank)


@functools.cache
def strategy_refusal(facts: ModelFacts, layout: Layout, gpus_per_node: int, per_rank_batch: int) -> str | None:
    """What MeshStrategy's own checks say against ``layout`` (as ``check_module`` runs them when
    ``uma fit`` starts): the mesh, the model's parallel plan, and under pp the schedule and the stages."""
    from uma_lightning.parallel.apply import ParallelConfig
    from uma_lightning.parallel.mesh import resolve_mesh_shape
    from uma_lightning.parallel.plans.generic import plan_or_generic

    try:
        shape = resolve_mesh_shape(dataclasses.asdict(layout.sizes()), layout.world_size, gpus_per_node)
        plan = plan_or_generic(facts.model)
        plan.check(facts.model, shape, ParallelConfig())
        if layout.pp > 1:
            pipeline = layout.pipeline_config()
            pipeline.check(layout.pp, per_rank_batch)
            plan.pipeline.check(facts.model, shape, pipeline)
    except ValueError as err:
        return str(err)
    return None
