"""Parallelism: the mesh strategy (DDP, FSDP2, tensor parallel, hybrids), per-model plans, and the parity tool.

Importing this package registers the strategy names ddp, fsdp, tp, hsdp, fsdp_tp, ep and ep_fsdp in
Lightning's strategy registry (the ``uma`` command imports it).
"""

from uma_lightning.parallel.apply import ParallelConfig
from uma_lightning.parallel.mesh import MeshShape
from uma_lightning.parallel.plans import HeadPlan, Plan, plan_for, register_head, register_plan
from uma_lightning.parallel.plans.robot import replicated
from uma_lightning.parallel.strategy import MeshStrategy, register_strategies

register_strategies()

__all__ = [
    "HeadPlan",
    "MeshShape",
    "MeshStrategy",
    "ParallelConfig",
    "Plan",
    "plan_for",
    "register_head",
    "register_plan",
    "replicated",
]
