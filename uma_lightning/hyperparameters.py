"""Hyperparameters a checkpoint keeps: every constructor argument of the class actually built, as plain values.

A LightningModule subclass (a stage module, an RL learner, research code on top of either) adds its
own arguments and forwards the rest as ``**kwargs``; its base class calls ``constructor_arguments``
once, and it collects the arguments of every ``__init__`` from the base class up to the class being
built, so a subclass-only argument is saved without the subclass saving anything. Dataclass sections
become dicts, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning.pytorch.utilities.parsing import collect_init_args


def constructor_arguments(frame, base: type) -> dict[str, Any]:
    """The arguments the ``__init__`` of ``base`` (running in ``frame``) and of its subclasses
    above it in the stack received, the most derived class's values last, as plain values."""
    arguments: dict[str, Any] = {}
    for local in collect_init_args(frame, [], classes=(base,)):
        arguments.update(local)
    return {name: plain(value) for name, value in arguments.items()}


def plain(value: Any) -> Any:
    """``value`` with dataclasses and config types that serialise themselves (``to_dict``, as
    ``ModelSize``) turned into dicts, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "to_dict", None)):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
