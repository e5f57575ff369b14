"""A network's units named by class: the outermost modules of the classes listed (Hugging Face's
``_no_split_modules`` convention), which data parallelism and activation checkpointing wrap one by one."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def outermost_of_classes(model: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """The modules of ``model`` whose class is named in ``class_names`` and that lie inside no other such module."""
    classes = set(class_names)
    units, inside = [], []
    for name, module in model.named_modules():
        if name and type(module).__name__ in classes and not name.startswith(tuple(inside)):
            units.append(module)
            inside.append(name + ".")
    return units
