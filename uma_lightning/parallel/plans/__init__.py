"""Parallel plans, one per model family, kept beside (not inside) the pure-PyTorch models.

A plan is two functions:

- ``parallelize(model, mesh, shape, config)`` applies tensor parallelism, activation
  checkpointing, compile and data parallelism to ``model`` in place, and returns what it applied;
- ``check(model, shape, config)`` raises a one-line ValueError when the model cannot be laid
  out on ``shape`` (e.g. heads that do not divide by tp). Strategies call it before any work starts.

A new model family gets a plan by registering it; the strategies look plans up by model class
(a subclass uses its parent's plan unless it registers its own):

    from uma_lightning.parallel import register_plan
    register_plan(MyPolicy, parallelize_my_policy, check_my_policy)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Plan:
    name: str
    parallelize: Callable
    check: Callable


_PLANS: dict[type, Plan] = {}


def register_plan(model_class: type, parallelize: Callable, check: Callable, name: str | None = None) -> None:
    _PLANS[model_class] = Plan(name or model_class.__name__, parallelize, check)


def plan_for(model: nn.Module) -> Plan | None:
    for klass in type(model).__mro__:
        if klass in _PLANS:
            return _PLANS[klass]
    return None


def registered_classes() -> list[str]:
    return sorted(klass.__name__ for klass in _PLANS)


def _register_builtin_plans() -> None:
    from uma_lightning.models import RobotTransformer
    from uma_lightning.parallel.plans.robot import check_robot, parallelize_robot

    register_plan(RobotTransformer, parallelize_robot, check_robot, name="robot")


_register_builtin_plans()
