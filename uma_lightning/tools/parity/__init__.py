"""``uma parity``: does a recipe train the same under each strategy as on one process?

    uma parity --config recipes/pretrain.yaml --strategies ddp,fsdp,tp --steps 4 [recipe overrides...]
    uma parity --config recipes/pretrain.yaml --precision bf16-mixed [--strategies fsdp] [recipe overrides...]

The recipe's model and data are resolved as ``uma fit`` would, and the first ``--steps`` batches
of its training data become the global batches. Each strategy trains on them in a group of gloo
processes on this machine (2, or 4 for the meshes hsdp, fsdp_tp, pp_fsdp, pp_fsdp_tp and ep_fsdp), each data-parallel rank
on its equal slice of every global batch, from the same initial weights as the references:

- one process on each whole global batch: the comparison that matters, judged against the
  tolerances in ``TOLERANCES``;
- one process accumulating gradients over the same slices, in rank order: strategies whose
  reductions add two numbers (``Tolerance.bitwise``) must match it bit for bit.

Two choices keep a correct strategy from ever looking wrong:

- every run is in float64, where reordering a sum moves it by ~1e-16 of its size, while a real
  bug moves gradients by ~1e-3: the tolerances sit many decades from both;
- each step of a strategy run starts from the reference's weights after the step before, so a
  difference cannot compound through the optimizer (AdamW divides each gradient element by its
  running size, which magnifies rounding noise of near-zero gradients step after step).

The verdict also checks that the initial weights equal the reference's, that every rank holds
the same copy of every replicated weight, and, for mixture-of-experts models, that every step
routes exactly as many tokens to each expert of each layer as one process does. For a strategy that fails, the report names the
first parameter in model order where the run parts ways: in the initial weights, between the
ranks, or in the gradients of the first step that differs (with the one that differs most).

``--precision bf16-mixed`` or ``16-mixed`` (``precision.py``) compares that precision with
fp32 instead, layer by layer, on one process or under one strategy.

Recipe keys are overridden as in ``uma fit`` (``--model.network.size ...``). Keep the model small: the
tool holds every step's full gradients and weights in memory.
"""

from uma_lightning.tools.parity.cli import main, resolve
from uma_lightning.tools.parity.layouts import LAYOUTS, TOLERANCES, Tolerance, data_parallel_size, needs_experts
from uma_lightning.tools.parity.runs import Case, check_parity, random_network

__all__ = [
    "LAYOUTS",
    "TOLERANCES",
    "Case",
    "Tolerance",
    "check_parity",
    "data_parallel_size",
    "main",
    "needs_experts",
    "random_network",
    "resolve",
]
