"""Parallelism: the mesh strategy (DDP, FSDP2, tensor, pipeline and expert parallel, hybrids) and per-model plans.

Importing changes nothing in Lightning. ``register_strategies()`` adds the names ddp, fsdp, tp, hsdp,
fsdp_tp, pp, ep... to Lightning's strategy registry, ours in place of its own ddp and fsdp; the ``uma``
command calls it, and so may a plain Lightning script that wants ``Trainer(strategy="fsdp_tp")``.
"""

from uma_lightning.parallel.apply import ParallelConfig
from uma_lightning.parallel.mesh import MeshShape, MeshSizes
from uma_lightning.parallel.pipeline import PipelineConfig
from uma_lightning.parallel.plans import HeadPlan, PipelineSplit, Plan, plan_for, register_head, register_plan
from uma_lightning.parallel.plans.robot import replicated
from uma_lightning.parallel.strategy import MeshStrategy, register_strategies

__all__ = [
    "HeadPlan",
    "MeshShape",
    "MeshSizes",
    "MeshStrategy",
    "ParallelConfig",
    "PipelineConfig",
    "PipelineSplit",
    "Plan",
    "plan_for",
    "register_head",
    "register_plan",
    "register_strategies",
    "replicated",
]
