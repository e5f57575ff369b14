"""The whole training state of a Lightning run, gathered for a checkpoint and put back on resume.

A checkpoint holds:

- ``model/<name>``: the LightningModule's parameters and buffers under their plain names. Names come
  from ``torch.distributed.checkpoint.state_dict``, which drops what wrappers add (``_orig_mod.`` from
  torch.compile, ``_checkpoint_wrapped_module.`` from activation checkpointing, ``_fsdp_wrapped_module.``),
  so a checkpoint of a compiled, checkpointed, sharded model loads into the plain model.
- ``optimizer/...``: optimizer state keyed by parameter name (reshardable); param groups in JSON.
- ``trainer``: global step, epoch, the fit loop's progress (which includes the gradient-accumulation
  position and the train loader's position), LR schedulers, grad scaler, callback and data-module
  states, what the callbacks' and the module's ``on_save_checkpoint`` hooks add, hyperparameters and
  the MLflow run id.
- ``rng/<rank>/...``: the random generator states of every rank.

Tensors go to torch.distributed.checkpoint files; everything else to ``state.json``, written by rank 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import MLFlowLogger
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_optimizer_state_dict

from uma_lightning.checkpoint import rng
from uma_lightning.checkpoint.codec import decode, encode, tensor_references
from uma_lightning.checkpoint.manifest import CheckpointError
from uma_lightning.checkpoint.storage import empty_like_saved, load_tensors, local_part, tensor_metadata
from uma_lightning.checkpoint.weights import MODEL, OPTIMIZER, RNG, TRAINER, read_state
from uma_lightning.lightning_compat import forget_train_loader
from uma_lightning.parallel.pipeline import pipeline_of
from uma_lightning.ranks import random_stream_rank

log = logging.getLogger(__name__)


def collect(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-able state, tensors by checkpoint key) of this rank.

    Parameters and optimizer state are the live tensors: they change only in the optimizer step, so a
    background save may copy them until then. Everything else (buffers, which a forward pass may
    update, RNG and trainer tensors) is copied here.
    """
    parts = model_and_optimizer(module, trainer.optimizers)
    parts[TRAINER] = _trainer_state(trainer, module)
    state, tensors = encode_parts(parts)
    if pipeline_of(module) is not None:
        # Each rank's optimizer holds its stages' parameters; state.json (rank 0's) must list them all.
        state[OPTIMIZER] = _union_over_ranks(state[OPTIMIZER])
    live = {_storage(p) for p in module.parameters()} | {
        _storage(t) for k, t in tensors.items() if k.startswith(OPTIMIZER + "/")
    }
    tensors = {key: value if _storage(value) in live else value.detach().clone() for key, value in tensors.items()}
    tensors.update({f"{RNG}/{trainer.global_rank}/{name}": value for name, value in rng.capture().items()})
    return state, tensors


def model_and_optimizer(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """Model and optimizer state under plain parameter names, sharded as the module is (DTensors under
    FSDP2 or tensor parallelism)."""
    model_state, optimizer_state = get_state_dict(module, optimizers)
    return {MODEL: model_state, OPTIMIZER: optimizer_state}


def encode_parts(parts: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    state, tensors = {}, {}
    for name, value in parts.items():
        state[name], part_tensors = encode(value, name)
        tensors.update(part_tensors)
    return state, tensors


def load(
    trainer: pl.Trainer, module: pl.LightningModule, directory: Path, process_group: Optional[dist.ProcessGroup]
) -> tuple[dict, Optional[dict]]:
    """Load model and optimizer state from ``directory`` in place, into whatever sharding they have now.

    Returns the trainer state (apply it with ``apply_trainer_state``) and this rank's saved RNG state,
    or None when the checkpoint was written by a different number of ranks.
    """
    saved = read_state(directory)
    entries = tensor_metadata(directory)
    extra = {key: empty_like_saved(entries[key]) for key in tensor_references(saved[TRAINER])}
    rng_prefix = f"{RNG}/{random_stream_rank(trainer)}/"  # the same for ranks that split one batch
    same_ranks = saved[TRAINER]["world_size"] == trainer.world_size
    if same_ranks:
        extra.update({key: empty_like_saved(entry) for key, entry in entries.items() if key.startswith(rng_prefix)})
    load_module(module, directory, trainer.optimizers, process_group, extra=extra)
    rng_state = {key.removeprefix(rng_prefix): value for key, value in extra.items() if key.startswith(rng_prefix)}
    return decode(saved[TRAINER], extra), rng_state if same_ranks else None


def load_module(
    module: nn.Module,
    directory: str | Path,
    optimizers: list[torch.optim.Optimizer] = (),
    process_group: Optional[dist.ProcessGroup] = None,
    prefix: str = "",
    extra: Optional[dict[str, torch.Tensor]] = None,
) -> None:
    """Load the weights (and the state of ``optimizers``) of ``directory`` into ``module`` in place,
    resharding from however they were saved to however they are sharded now.

    ``prefix`` selects a submodule of the saved module: ``load_module(net, path, prefix="model.")``
    loads the network of a LightningModule (its ``model`` attribute) into a plain network.
    ``extra`` tensors, keyed like the checkpoint, are filled too.
    """
    directory = Path(directory)
    saved = read_state(directory)
    current = model_and_optimizer(module, list(optimizers))
    model_refs, model_tensors = encode({prefix + name: value for name, value in current[MODEL].items()}, MODEL)
    saved_model = {key for key in tensor_metadata(directory) if key.startswith(f"{MODEL}/{prefix}")}
    staged = pipeline_of(module) is not None
    # A pipeline stage holds part of the model: the stages together must match the checkpoint.
    expected = {key for keys in _gather(set(model_tensors)) for key in keys} if staged else set(model_tensors)
    _check_same_parameters(directory, expected, saved_model)
    _, optimizer_tensors = encode(current[OPTIMIZER], OPTIMIZER)
    saved_optimizer = (
        _own_parameters(saved[OPTIMIZER], current[OPTIMIZER]) if staged and optimizers else saved[OPTIMIZER]
    )
    wanted = tensor_references(saved_optimizer) if optimizers else []
    unknown = sorted(set(wanted) - set(optimizer_tensors))
    if unknown:
        raise CheckpointError(
            f"{directory}: optimizer state {unknown[:3]} does not match this run's optimizer (another optimizer type?)"
        )
    targets = {**model_tensors, **{key: optimizer_tensors[key] for key in wanted}, **(extra or {})}
    load_tensors(targets, directory, process_group)
    model_state = {name.removeprefix(prefix): value for name, value in decode(model_refs, targets).items()}
    if not _is_live(module, model_state):
        set_model_state_dict(module, model_state)
    if optimizers:
        set_optimizer_state_dict(module, list(optimizers), decode(saved_optimizer, targets))


def apply_trainer_state(trainer: pl.Trainer, module: pl.LightningModule, state: dict) -> None:
    """Put back what ``_trainer_state`` gathered, so Lightning's loops continue where the checkpoint was taken."""
    trainer.fit_loop.load_state_dict(state["loops"]["fit_loop"])
    _rebuild_train_loader(trainer)
    configs = trainer.lr_scheduler_configs
    if len(configs) != len(state["lr_schedulers"]):
        raise CheckpointError(f"checkpoint has {len(state['lr_schedulers'])} LR scheduler(s), this run {len(configs)}")
    for config, scheduler_state in zip(configs, state["lr_schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    trainer.precision_plugin.load_state_dict(state["precision"])
    # In the order of Lightning's own restore: the module's hook, the data module, then each callback's
    # hook and its state_dict.
    extras = state["hooks"] if "hooks" in state else state["module"]  # "module": saved before callbacks' hooks were
    module.on_load_checkpoint(extras)
    if trainer.datamodule is not None:
        trainer.datamodule.load_state_dict(state["datamodule"])
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, module, extras)
        if callback.state_key in state["callbacks"]:
            callback.load_state_dict(state["callbacks"][callback.state_key])


def _trainer_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    callback_states = {callback.state_key: state for callback in trainer.callbacks if (state := callback.state_dict())}
    # As Lightning's own save does: the callbacks' hooks, then the module's, all writing into one dict.
    # The hooks also tell callbacks that a save is under way (the hang watchdog counts it as progress).
    extras: dict[str, Any] = {}
    for callback in trainer.callbacks:
        callback.on_save_checkpoint(trainer, module, extras)
    module.on_save_checkpoint(extras)
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "world_size": trainer.world_size,
        # Saves happen only right after an optimizer step, so no gradients are mid-accumulation;
        # the position within an accumulation cycle is part of the fit loop's batch progress.
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "loops": {"fit_loop": trainer.fit_loop.state_dict()},
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "callbacks": callback_states,
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else {},
        "hooks": extras,
        "hyper_parameters": _plain_hyperparameters(module),
        "mlflow_run_id": mlflow_run_id(trainer),
    }


def mlflow_run_id(trainer: pl.Trainer) -> Optional[str]:
    logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
    return logger.run_id if logger is not None and trainer.is_global_zero else None


def _plain_hyperparameters(module: pl.LightningModule) -> Optional[dict]:
    """The hyperparameters, for tools that rebuild the model from a checkpoint; None (with a warning)
    when they hold objects that JSON cannot hold."""
    try:
        encode(dict(module.hparams), "hyper_parameters")
    except TypeError as err:
        log.warning("checkpoint without hyperparameters: %s", err)
        return None
    return dict(module.hparams)


def _gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _union_over_ranks(optimizer: dict) -> dict:
    """The optimizer state structure of every rank together (under pipeline parallelism, of every stage), parameters in rank order."""
    union = {"state": {}, "param_groups": [{**group, "params": []} for group in optimizer["param_groups"]]}
    for part in _gather(optimizer):
        for name, value in part["state"].items():
            union["state"].setdefault(name, value)
        for group, part_group in zip(union["param_groups"], part["param_groups"]):
            group["params"] += [name for name in part_group["params"] if name not in group["params"]]
    return union


def _own_parameters(saved: dict, current: dict) -> dict:
    """The part of a saved optimizer state structure that covers this rank's parameters (its pipeline stages')."""
    own = {name for group in current["param_groups"] for name in group["params"]}
    return {
        "state": {name: value for name, value in saved["state"].items() if name in own},
        "param_groups": [
            {**group, "params": [name for name in group["params"] if name in own]} for group in saved["param_groups"]
        ],
    }


def _check_same_parameters(directory: Path, expected: set[str], saved: set[str]) -> None:
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: the model does not match the checkpoint: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )


def _is_live(module: nn.Module, model_state: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``model_state`` is the module's own (the load wrote into the module itself),
    so that putting them back would only copy each onto itself."""
    live = {_place(value) for value in module.state_dict().values()}
    return all(_place(value) in live for value in model_state.values())


def _place(tensor: torch.Tensor) -> tuple:
    local = local_part(tensor)
    return local.data_ptr(), local.shape, local.stride(), local.dtype


def _storage(tensor: torch.Tensor) -> int:
    return local_part(tensor).untyped_storage().data_ptr()


def _rebuild_train_loader(trainer: pl.Trainer) -> None:
    """Make the fit loop build the train loader again, now that the loop holds the loader's saved position.

    ``configure_optimizers`` asking for ``trainer.estimated_stepping_batches`` makes Lightning build the
    train loader, and start iterating it, before any checkpoint is restored; Lightning then never hands
    that loader its saved position (Lightning issue 20550). Dropping it makes the fit loop rebuild it
    and load the position first.
    """
    forget_train_loader(trainer)
