"""Gradient norm and clipping over parameters laid out on different meshes, and over pipeline stages.

With expert parallelism the experts live on the ep mesh (and their own data-parallel ranks) while
the other parameters live on the dense data-parallel mesh, or are plain tensors. torch's
``clip_grad_norm_`` stacks the per-parameter norms into one tensor, which DTensors of different
meshes refuse. Here the norm is taken per layout (mesh and placements), each reduced over its own
mesh, then combined; with a single layout it is exactly torch's result.

Under pipeline parallelism each stage holds other parameters: the global norm adds the stages'
squared norms over the ``pp`` mesh dimension, and every stage scales its gradients by the same factor.

The anomaly detector needs each parameter's gradient norm just before clipping needs their total:
``gradient_norms`` keeps its last result for as long as the same gradients are unchanged, so a step
computes them once.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import Tensor, nn

_last_norms: Optional[tuple[list[weakref.ref], list[int], list[Tensor]]] = None


def gradient_norms(grads: list[Tensor]) -> list[Tensor]:
    """The 2-norm of each of ``grads`` (plain tensors), as ``torch.nn.utils.get_total_norm`` takes them;
    the previous call's result when it was given the very same gradients, none modified since."""
    global _last_norms
    if _last_norms is not None:
        references, versions, norms = _last_norms
        if len(references) == len(grads) and all(
            reference() is grad and version == grad._version
            for reference, version, grad in zip(references, versions, grads)
        ):
            return norms
    norms = list(torch._foreach_norm(grads))
    _last_norms = ([weakref.ref(grad) for grad in grads], [grad._version for grad in grads], norms)
    return norms


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, device_mesh=None) -> Tensor:
    """The total 2-norm of the parameters' gradients (over every pipeline stage of ``device_mesh``),
    after scaling them to at most ``max_norm`` (inf: measure only)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    layouts: dict[tuple, list[Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        layouts.setdefault(key, []).append(grad)
    norms = []
    for key, group in layouts.items():
        if key is None and len({(grad.device, grad.dtype) for grad in group}) == 1:
            norm = torch.linalg.vector_norm(torch.stack(gradient_norms(group)))  # get_total_norm's own steps
        else:
            norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    # Summed in the order the layouts first appear in the model: the same on every rank and every run.
    if not norms:
        total = torch.tensor(0.0)
    else:
        total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if device_mesh is not None and "pp" in (device_mesh.mesh_dim_names or ()) and device_mesh["pp"].size() > 1:
        import torch.distributed as dist

        squares = total.square()
        dist.all_reduce(squares, group=device_mesh["pp"].get_group())
        total = squares.sqrt()
    if math.isfinite(max_norm):
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grads_with_norm_'s factor
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale.to(grad.dtype))
    return total
