"""Parallel plans, one per backbone family, kept beside (not inside) the pure-PyTorch models.

A plan is the whole parallel contract of a family (``Plan``):

- ``parallelize(model, mesh, config)`` applies tensor parallelism, activation checkpointing,
  compile and data parallelism to ``model`` in place, and returns what it applied;
- ``check(model, shape, config)`` raises a one-line ValueError when the model cannot be laid
  out on ``shape`` (e.g. heads that do not divide by tp). Strategies call it before any work starts;
- ``pipeline``: how it is cut into pipeline stages (``PipelineSplit``), or None (no pp).

A network without a registered plan gets the generic one (``generic.py``): data parallelism,
activation checkpointing and compile on its repeated blocks, and tensor parallelism from a
``tp_plan`` it declares as data.

A new backbone family gets a plan by registering it; the strategies look plans up by model class
(a subclass uses its parent's plan unless it registers its own):

    from uma_lightning.parallel import register_plan
    register_plan(MyPolicy, parallelize_my_policy, check_my_policy, pipeline=PipelineSplit(check, apply))

The heads around a backbone (an action head, an action expert, an auxiliary output) plug into
their family's plan as a ``HeadPlan``, registered for the model class that adds the head. A model
gets the heads of every class it derives from, so a research subclass that adds a head registers
only that head's few lines:

    register_head(MyRobot, HeadPlan("progress", tp_layout=replicated("progress_head")))
"""

from __future__ import annotations

from uma_lightning.parallel.plans.registry import (
    HeadPlan,
    PipelineSplit,
    Plan,
    heads_for,
    plan_for,
    register_head,
    register_plan,
    registered_classes,
)

__all__ = [
    "HeadPlan",
    "PipelineSplit",
    "Plan",
    "heads_for",
    "plan_for",
    "register_head",
    "register_plan",
    "registered_classes",
]


def _register_builtin_plans() -> None:
    from uma_lightning.models import RobotBase, RobotFlowTransformer, RobotTransformer
    from uma_lightning.parallel.plans.flow import ACTION_EXPERT
    from uma_lightning.parallel.plans.pipeline import check_pipeline, pipeline_robot
    from uma_lightning.parallel.plans.robot import (
        DISCRETE_ACTION_HEAD,
        ENVIRONMENT_STATE_HEAD,
        check_robot,
        parallelize_robot,
    )

    register_plan(
        RobotBase, parallelize_robot, check_robot, name="robot", pipeline=PipelineSplit(check_pipeline, pipeline_robot)
    )
    register_head(RobotBase, ENVIRONMENT_STATE_HEAD)
    register_head(RobotTransformer, DISCRETE_ACTION_HEAD)
    register_head(RobotFlowTransformer, ACTION_EXPERT)


_register_builtin_plans()
