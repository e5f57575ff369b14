"""A training step's FLOPs, counted rather than assumed.

``torch.utils.flop_counter.FlopCounterMode`` counts the FLOPs of one forward and backward of the
stage's ``compute_loss`` on a batch, with the network rebuilt on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``): shapes and dtypes flow through every op, no
memory is allocated and nothing is computed. So the figure is that of the actual network, loss and
batch, a research network's as much as ours, and costs next to nothing. The rebuilt network is the
whole, unwrapped one, so the figure is per sample of the model, whatever strategy shards it;
parameters the live network does not train (frozen, LoRA bases) get no gradient in the count either.

A step that depends on values (routing tokens to experts by their count, a ``.tolist()``) cannot
run on fake tensors; it is then counted once on real ones, on a fresh copy of the network (its
parameters' memory, and one step's compute). Random generators (python, numpy, torch) are left as
they were either way.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from uma_lightning.checkpoint import rng

# Segments that wrappers (activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


class FlopCountError(RuntimeError):
    """The network's training step cannot be counted."""


def count_training_flops(stage_module, batch: dict) -> tuple[int, str]:
    """FLOPs of one forward and backward of ``stage_module.compute_loss(batch)`` over the whole batch,
    and how they were counted (for the log). The stage's network is rebuilt with ``build_model()``
    and stands in for ``stage_module.model`` during the count only."""
    try:
        return _count(stage_module, batch, fake=True), "on fake tensors"
    except Exception as err:  # noqa: BLE001  (whatever a value-dependent step raises on fake tensors)
        why = _first_line(err)
    try:
        return _count(
            stage_module, batch, fake=False
        ), f"on real tensors, since the step cannot run on fake ones ({why})"
    except Exception as err:  # noqa: BLE001  (whatever the network raises: the caller reports it)
        raise FlopCountError(_first_line(err)) from err


def _count(stage_module, batch: dict, fake: bool) -> int:
    with step_on_rebuilt_network(stage_module, batch, fake) as mode, mode, FlopCounterMode(display=False) as counter:
        stage_module.compute_loss(batch)["loss"].backward()
    return int(counter.get_total_flops())


@contextlib.contextmanager
def step_on_rebuilt_network(stage_module, batch: dict, fake: bool = True):
    """The stage's network rebuilt with ``build_model()`` (on fake tensors where ``fake``, with the
    live one's trainable parameters and dtype) stands in for ``stage_module.model`` inside the
    block; yields the mode to run a step under (a ``FakeTensorMode``, or nothing to enter). The
    random generators are left as they were."""
    device = next((value.device for value in batch.values() if torch.is_tensor(value)), torch.device("cpu"))
    # Fake tensors hold no values, so the batch stays real; whatever it meets is fake.
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    live = stage_module.model
    with _generators_kept(), _quiet_fake_tensor_errors():
        with torch.device("meta" if fake else device):  # initialisation on fake tensors would read values
            network = stage_module.build_model()
        if live is not None:
            _copy_trainable(live, network)
        dtype = _dtype_of(live) or _dtype_of(network)
        if dtype is not None:
            network.to(dtype)
        if fake:
            with mode:
                network.to_empty(device=device)
        stage_module.model = network
        try:
            yield mode
        finally:
            stage_module.model = live


@contextlib.contextmanager
def _generators_kept():
    """Every generator a loss may draw from (python, numpy, torch CPU and CUDA) as it was before the
    count: a resumed run, which counts at its own first step, must draw what the uninterrupted one drew."""
    state = rng.capture()
    try:
        yield
    finally:
        rng.restore(state)


@contextlib.contextmanager
def _quiet_fake_tensor_errors():
    """Fake tensors log an op they cannot run before raising; the raise is reported, once, by the caller."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _copy_trainable(live: nn.Module, network: nn.Module) -> None:
    trainable = {_plain_name(name): p.requires_grad for name, p in live.named_parameters()}
    for name, parameter in network.named_parameters():
        if name in trainable:
            parameter.requires_grad_(trainable[name])


def _dtype_of(network: nn.Module | None) -> torch.dtype | None:
    """The floating dtype of a network's parameters (float64 under ``uma parity``, a half type under
    bf16-true), so the rebuilt network computes as the live one does; None where they differ."""
    dtypes = {p.dtype for p in network.parameters() if p.is_floating_point()} if network is not None else set()
    return dtypes.pop() if len(dtypes) == 1 else None


def _plain_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _first_line(err: Exception) -> str:
    message = str(err).strip()
    return f"{type(err).__name__}: {message.splitlines()[0]}" if message else type(err).__name__


def batch_size_of(batch: dict) -> int:
    return len(batch["sample_id"]) if "sample_id" in batch else len(next(iter(batch.values())))
