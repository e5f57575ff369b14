"""The parallel plan of any network without a registered one: its layout read from the network itself.

Data parallelism (ddp, fsdp, hsdp), activation checkpointing and compile need only the units to
wrap one by one, found in this order:

- named by the network: ``fsdp_units``, a method returning the modules or a list of class names,
  or Hugging Face's ``_no_split_modules`` (class names); the outermost modules of those classes;
- found from its structure: the children of its ``ModuleList``s and ``Sequential``s, grouped by
  container and class, the group of two or more holding the most parameters (the repeated blocks).
  A network without one is a single unit (its root).

Tensor parallelism takes a layout declared as data: ``tp_plan``, a mapping from module-name
patterns (``fnmatch``, one dotted level per part: "blocks.*.fc1") to "colwise" (a linear layer's
output features split over the tp ranks) or "rowwise" (its input features; the partial results
summed), applied with ``parallelize_module``; a network may also refuse a tp size itself, in
``check_tensor_parallel(tp)`` (e.g. key/value heads that tp does not divide). A column-wise layer takes a plain (whole) input and
gives its slice of the features; the row-wise layer after it takes that slice and gives the whole
output, so a pair leaves plain tensors around it. Modules outside the layout stay plain tensors,
computed whole on every tp rank.

Pipeline and expert parallelism have no layout as data yet: a network without a plan is refused
there, before any work, in one line naming what to declare.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from uma_lightning.models.units import outermost_of_classes
from uma_lightning.parallel.apply import ParallelConfig
from uma_lightning.parallel.mesh import MeshShape
from uma_lightning.parallel.plans.registry import Plan, plan_for
from uma_lightning.parallel.plans.robot import apply_inference_methods, lay_out

TP_STYLES = ("colwise", "rowwise")
TP_PLAN_EXAMPLE = "{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}"


def data_parallel_units(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The modules to wrap one by one, and why those (for the plan's log line)."""
    network = type(model).__name__
    named = getattr(model, "fsdp_units", None)
    if callable(named):
        units = list(named())
        return units, f"{len(units)} unit(s) named by {network}.fsdp_units()"
    attribute = "fsdp_units" if named is not None else "_no_split_modules"
    class_names = set(named if named is not None else getattr(model, "_no_split_modules", None) or ())
    if class_names:
        units = outermost_of_classes(model, class_names)
        return (
            units,
            f"{len(units)} unit(s) of the classes {network}.{attribute} names ({', '.join(sorted(class_names))})",
        )
    groups: dict[tuple[str, type], list[nn.Module]] = {}
    for container_name, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child in container.children():
                if next(child.parameters(), None) is not None:
                    groups.setdefault((container_name, type(child)), []).append(child)
    repeated = [(key, blocks) for key, blocks in groups.items() if len(blocks) >= 2]
    if not repeated:
        return (
            [],
            f"{network} has no repeated blocks (no ModuleList or Sequential of two modules of one class): one unit, the root",
        )
    (container_name, block_class), blocks = max(
        repeated, key=lambda item: sum(p.numel() for block in item[1] for p in block.parameters())
    )
    where = container_name or "the model itself"
    return blocks, f"{len(blocks)} x {block_class.__name__} in {where}, the largest group of repeated blocks"


def tensor_parallel_layout(model: nn.Module) -> dict[str, str] | None:
    return getattr(model, "tp_plan", None)


def check_generic(model: nn.Module, shape: MeshShape, config: ParallelConfig) -> None:
    network = type(model).__name__
    if shape.ep > 1:
        raise ValueError(
            f"ep {shape.ep}: {network} has no registered plan, and expert parallelism has no layout as data; "
            "register a plan for it (uma_lightning.parallel.register_plan) or train it with ddp, fsdp or hsdp"
        )
    if shape.tp == 1:
        return
    layout = tensor_parallel_layout(model)
    if not layout:
        raise ValueError(
            f"tp {shape.tp}: {network} has no registered plan and declares no tensor-parallel layout; give it "
            f"tp_plan = {{module-name pattern: 'colwise' or 'rowwise'}}, e.g. {TP_PLAN_EXAMPLE}"
        )
    check_split = getattr(model, "check_tensor_parallel", None)
    if callable(check_split):
        check_split(shape.tp)
    modules = dict(model.named_modules())
    for pattern, style in layout.items():
        if style not in TP_STYLES:
            raise ValueError(f"{network}.tp_plan[{pattern!r}]: style must be colwise or rowwise, got {style!r}")
        matched = [name for name in modules if name and _matches(name, pattern)]
        if not matched:
            raise ValueError(f"{network}.tp_plan[{pattern!r}] matches no module of {network}")
        for name in matched:
            linear = modules[name]
            if not isinstance(linear, nn.Linear):
                raise ValueError(
                    f"{network}.tp_plan[{pattern!r}]: {name} is a {type(linear).__name__}; colwise and rowwise split nn.Linear layers"
                )
            features, what = (linear.out_features, "output") if style == "colwise" else (linear.in_features, "input")
            if features % shape.tp:
                raise ValueError(
                    f"tp {shape.tp} does not divide the {features} {what} features of {name} ({style} in {network}.tp_plan)"
                )


def tp_styles(model: nn.Module) -> dict[str, str]:
    """The style of every module ``tp_plan`` lays out, by name (none without a layout)."""
    layout = tensor_parallel_layout(model) or {}
    return {
        name: style
        for name, _ in model.named_modules()
        for pattern, style in layout.items()
        if name and _matches(name, pattern)
    }


def _matches(name: str, pattern: str) -> bool:
    """As parallelize_module matches a plan key: level by level, each by fnmatch."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(fnmatch(p, q) for p, q in zip(parts, pattern_parts))


def apply_tp_plan(model: nn.Module, tp_mesh) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layout = tensor_parallel_layout(model)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {pattern: styles[style]() for pattern, style in layout.items()})
    return f"tensor parallel over {tp_mesh.size()} ranks: {len(tp_styles(model))} linear layers from {type(model).__name__}.tp_plan"


def parallelize_generic(model: nn.Module, mesh, config: ParallelConfig) -> list[str]:
    """The units (why they were chosen first, for the log line), then the layout the robot plan's
    ``lay_out`` applies in its order: TP, AC, compile, data parallel."""
    blocks, why = data_parallel_units(model)
    applied = lay_out(model, blocks, mesh, config, lambda: [apply_tp_plan(model, mesh["tp"])])
    # A network's predict_actions need not call its forward (a VLM's encodes the prefix itself).
    applied.append(apply_inference_methods(model, tp=mesh["tp"].size() > 1))
    return [f"units: {why}", *(line for line in applied if line)]


GENERIC_PLAN = Plan("generic", parallelize_generic, check_generic)


def plan_or_generic(model: nn.Module) -> Plan:
    """The plan that lays ``model`` out: its class's registered one, else the generic one."""
    return plan_for(model) or GENERIC_PLAN
