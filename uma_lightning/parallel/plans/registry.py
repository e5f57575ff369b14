"""The registry of parallel plans and of the heads that plug into them (described in ``plans/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PipelineSplit:
    """How a family runs in pipeline stages (``pp`` above one).

    - ``check(model, shape, pipeline)``: a one-line ValueError where the model cannot be cut into the
      stages ``pipeline`` (a ``PipelineConfig``) asks for on ``shape``;
    - ``apply(model, mesh, config, pipeline, device)``: cuts the model to this rank's stages, lays
      them out, makes ``model(...)`` run the schedule (setting ``model.pipeline``); returns what it applied.
    """

    check: Callable
    apply: Callable


@dataclass(frozen=True)
class Plan:
    """The whole parallel contract of a model family.

    - ``parallelize(model, mesh, config)``: tensor layout, activation checkpointing, compile and data
      parallelism, in place; returns what it applied;
    - ``check(model, shape, config)``: a one-line ValueError where the model cannot be laid out on ``shape``;
    - ``pipeline``: its split into pipeline stages, or None where the family has none (pp is then refused).
    """

    name: str
    parallelize: Callable
    check: Callable
    pipeline: PipelineSplit | None = None


def _no_blocks(model: nn.Module) -> list[nn.Module]:
    return []


def _no_sizes(model: nn.Module) -> dict[str, int]:
    return {}


def _always(model: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class HeadPlan:
    """What a backbone family's plan needs to know about one head.

    - ``blocks(model)``: the head's repeated blocks, each wrapped on its own (activation
      checkpointing, compile, FSDP or DDP) like the backbone's; the rest of the head goes with the root;
    - ``tp_sizes(model)``: sizes tensor parallelism must divide, by name (for the one-line error);
    - ``tp_layout(model, tp_mesh)``: lays the head's modules out on the tensor-parallel mesh, so that
      it reads what the backbone leaves (replicated DTensors) and returns plain tensors, or None;
    - ``forward_inputs``: tensor arguments the model's ``forward`` takes for this head after the
      observation's (images, state, text ids, text mask); replicated over the tensor-parallel group;
    - ``present(model)``: False where this instance was built without the head (an optional one);
    - ``tp_colwise``: the head's modules that ``tp_layout`` splits column-wise (the planner predicts their shards).
    """

    name: str
    blocks: Callable[[nn.Module], list[nn.Module]] = _no_blocks
    tp_sizes: Callable[[nn.Module], dict[str, int]] = _no_sizes
    tp_layout: Callable | None = None
    forward_inputs: int = 0
    present: Callable[[nn.Module], bool] = _always
    tp_colwise: tuple[str, ...] = ()


_PLANS: dict[type, Plan] = {}
_HEADS: dict[type, list[HeadPlan]] = {}


def register_plan(
    model_class: type,
    parallelize: Callable,
    check: Callable,
    name: str | None = None,
    pipeline: PipelineSplit | None = None,
) -> None:
    _PLANS[model_class] = Plan(name or model_class.__name__, parallelize, check, pipeline)


def register_head(model_class: type, head: HeadPlan) -> None:
    """Plug ``head`` into the plan of ``model_class``'s family, for it and its subclasses."""
    heads = _HEADS.setdefault(model_class, [])
    heads[:] = [h for h in heads if h.name != head.name] + [head]


def plan_for(model: nn.Module) -> Plan | None:
    for klass in type(model).__mro__:
        if klass in _PLANS:
            return _PLANS[klass]
    return None


def heads_for(model: nn.Module) -> list[HeadPlan]:
    """The heads ``model`` has: those registered for its class and its bases, bases' first."""
    heads = [head for klass in reversed(type(model).__mro__) for head in _HEADS.get(klass, [])]
    return [head for head in heads if head.present(model)]


def registered_classes() -> list[str]:
    return sorted(klass.__name__ for klass in _PLANS)
