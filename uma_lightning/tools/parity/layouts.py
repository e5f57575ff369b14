"""The strategies parity checks: each one's processes and mesh, and how far from one process it may be."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from lightning.pytorch.plugins.precision import DoublePrecision

from uma_lightning.parallel.mesh import MeshSizes
from uma_lightning.tools.parity.recorded_runs import COMPARE_DTYPE

log = logging.getLogger("uma_lightning")

PRECISIONS = ("bf16-mixed", "16-mixed")
# Trainer arguments for float64 runs. As a plugin, not precision="64-true": Lightning refuses that
# flag with ModelParallelStrategy, whose parallelisms (DTensor, FSDP2, gloo) all handle float64.
FLOAT64 = {"plugins": [DoublePrecision()]}


@dataclass(frozen=True)
class Tolerance:
    loss: float  # max over steps of |loss - reference loss| / max(1, |reference loss|)
    grad: float  # max abs gradient difference / the reference gradient's largest element, per parameter and step
    update: float  # per step: |params - reference params| / |reference update of that step| (L2 over all parameters)
    bitwise: bool  # must equal the rank-ordered accumulation bit for bit
    why: str


# How far a correct strategy may be from one process, from the dtype and the sizes of the sums
# it reorders. A sum of n terms evaluated in another order moves by at most ~n * eps of the sum
# of their magnitudes (by ~sqrt(n) * eps in practice, the roundings having random signs). The
# longest sums a strategy reorders are a weight gradient's sum over the global batch's tokens
# and, under tensor parallelism, the partial products of the row-wise matmuls; for the models
# this tool can hold both stay under REDUCTION_TERMS. Gradients are judged against their largest
# element, so cancellation inside a sum counts against the margin: REDUCTION_TERMS * eps, 2.2e-11
# in float64, sits about four decades above the differences measured (a 3-layer, width-128 model
# under ddp, fsdp and tp: 2.4e-15 of a gradient's scale, 1.7e-16 of the loss) and eight below a
# real bug's (1e-3 and more). benchmarks/parity_sweep.py measures the margin on random shapes.
EPS = torch.finfo(COMPARE_DTYPE).eps
REDUCTION_TERMS = 1e5
SUM_TOLERANCE = REDUCTION_TERMS * EPS
# One AdamW step from the same weights: the update of an element is m / (sqrt(v) + eps_adam), whose
# slope in the gradient is at most 1 / eps_adam (1e8) where the gradient is near zero. Such elements
# are few, so in L2 over all parameters the update moves by far less; ADAM_GAIN bounds that gain
# (measured on the model above: 5e-14 against gradients' 2.4e-15, a gain near 20).
ADAM_GAIN = 1e3


def _tolerance(bitwise: bool, why: str) -> Tolerance:
    return Tolerance(loss=SUM_TOLERANCE, grad=SUM_TOLERANCE, update=SUM_TOLERANCE * ADAM_GAIN, bitwise=bitwise, why=why)


TOLERANCES = {
    "ddp": _tolerance(
        True,
        "each rank sums over its half of the batch inside the matmuls and the all-reduce adds the halves; one process "
        "sums over the whole batch in one matmul, and addition is not associative. Against one process that "
        "accumulates the same halves in rank order, DDP is bitwise identical: adding two numbers is exact to reorder",
    ),
    "fsdp": _tolerance(
        False,
        "as ddp for the gradients (the reduce-scatter adds the two halves). Not bitwise against accumulation: the "
        "clipping norm is summed from per-shard norms",
    ),
    "tp": _tolerance(
        False,
        "row-wise layers add partial matmul products across ranks, in the forward and the backward: every layer "
        "reorders sums, not just the final gradient reduction",
    ),
    "hsdp": _tolerance(
        False, "as fsdp, with four ranks' gradients summed in two stages (within, then across replicas)"
    ),
    "fsdp_tp": _tolerance(False, "the tp and fsdp reorderings together"),
    "pp": _tolerance(
        False,
        "each stage's gradients are summed over microbatches (as gradient accumulation sums them) and divided by their "
        "number after; the clipping norm adds the stages' squared norms",
    ),
    "pp_fsdp": _tolerance(False, "the pp and fsdp reorderings together"),
    "pp_fsdp_tp": _tolerance(False, "the pp and tp reorderings together (fsdp too where the processes allow it)"),
    "ep": _tolerance(
        False,
        "as ddp for the other parameters. An expert's owner sums the gradient over both ranks' tokens in one matmul, "
        "where the accumulating reference adds two per-slice sums",
    ),
    "ep_fsdp": _tolerance(
        False, "the ep reordering, with the dense and the expert gradients summed by reduce-scatters"
    ),
}

# Processes and mesh per strategy: the 2-D meshes use two ranks in each dimension so both are real.
LAYOUTS = {
    "ddp": (2, MeshSizes(dp_replicate=2, dp_shard=1)),
    "fsdp": (2, MeshSizes(dp_shard=2)),
    "tp": (2, MeshSizes(dp_shard=1, tp=2)),
    "hsdp": (4, MeshSizes(dp_replicate=2, dp_shard=2)),
    "fsdp_tp": (4, MeshSizes(dp_shard=2, tp=2)),
    "pp": (2, MeshSizes(pp=2, dp_shard=1)),
    "pp_fsdp": (4, MeshSizes(pp=2, dp_shard=2)),
    # On four processes the FSDP dimension has one rank: tp and pp are what it checks together.
    "pp_fsdp_tp": (4, MeshSizes(pp=2, dp_shard=1, tp=2)),
    # Experts split over 2 ranks: all of them under ep (the rest DDP); under ep_fsdp each rank's
    # experts are FSDP-sharded over 2 more, as the dense layers are over all 4.
    "ep": (2, MeshSizes(dp_replicate=2, dp_shard=1, ep=2)),
    "ep_fsdp": (4, MeshSizes(dp_shard=4, ep=2)),
}


def needs_experts(name: str) -> bool:
    """Whether the strategy splits experts (ep above one), which refuses a model without mixture-of-experts layers."""
    return LAYOUTS[name][1].ep > 1


def data_parallel_size(name: str) -> int:
    sizes = LAYOUTS[name][1]
    return sizes.dp_replicate * sizes.dp_shard
