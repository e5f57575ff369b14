"""Training state as JSON plus a flat dict of tensors, so that loading a checkpoint unpickles nothing.

Loop progress, optimizer param groups, scheduler and callback states are nested dicts, lists and
tuples of numbers and strings, with tensors inside some of them. ``encode`` takes the tensors out
(they are saved with torch.distributed.checkpoint under their path, e.g. ``optimizer/state/w/exp_avg``)
and leaves a reference; tuples and dicts with non-string keys are tagged so they come back as they
were. Any other type is refused with its path: it could not be restored without pickle.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"
_TAGS = {TENSOR, TUPLE, ITEMS}


def encode(tree: Any, path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able tree, ``{path: tensor}``) for ``tree``; ``path`` names the root in tensor keys and errors."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(tree, path, tensors), tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {TENSOR: path}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and not _TAGS & set(value):
            return {key: _encode(item, f"{path}/{key}", tensors) for key, item in value.items()}
        return {
            ITEMS: [
                [_encode(key, f"{path}/{key}", tensors), _encode(item, f"{path}/{key}", tensors)]
                for key, item in value.items()
            ]
        }
    if isinstance(value, list):
        return [_encode(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]
    if isinstance(value, tuple):
        return {TUPLE: [_encode(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]}
    raise TypeError(
        f"{path}: a {type(value).__name__} cannot be stored in a checkpoint without pickle; "
        "keep state to dicts, lists, tuples, numbers, strings and tensors"
    )


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``encode``: references are replaced by ``tensors[key]``."""
    if isinstance(tree, list):
        return [decode(item, tensors) for item in tree]
    if not isinstance(tree, dict):
        return tree
    if TENSOR in tree:
        return tensors[tree[TENSOR]]
    if TUPLE in tree:
        return tuple(decode(item, tensors) for item in tree[TUPLE])
    if ITEMS in tree:
        return {_hashable(decode(key, tensors)): decode(item, tensors) for key, item in tree[ITEMS]}
    return {key: decode(item, tensors) for key, item in tree.items()}


def tensor_references(tree: Any) -> list[str]:
    """The tensor keys an encoded tree refers to."""
    if isinstance(tree, list):
        return [key for item in tree for key in tensor_references(item)]
    if not isinstance(tree, dict):
        return []
    if TENSOR in tree:
        return [tree[TENSOR]]
    return [key for item in tree.values() for key in tensor_references(item)]


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
