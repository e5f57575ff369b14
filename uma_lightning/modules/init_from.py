"""Starting a training stage from an earlier stage's checkpoint: read its weights, map them by name.

Parameter names do not depend on how the checkpoint was trained (strategy, world size, wrappers),
so mapping is by name: a key the new model lacks, a key the checkpoint lacks, or a shape that
differs is an error listing the keys, unless the stage declares it (an action head it replaces,
a new module it trains from scratch).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from uma_lightning.checkpoint import CheckpointError
from uma_lightning.checkpoint.codec import decode
from uma_lightning.checkpoint.state import MODEL, TRAINER, read_state, read_weights

log = logging.getLogger("uma_lightning")

MODEL_PREFIX = "model."
EMA_PREFIX = "ema_model."


@dataclass(frozen=True)
class CheckpointWeights:
    path: str
    hparams: dict
    weights: dict[str, torch.Tensor]  # names inside the LightningModule's ``model``
    ema: bool  # the weights are the exponential moving average
    module_class: str | None  # the LightningModule that wrote the checkpoint, as "package.module.Class"


@dataclass(frozen=True)
class KeyMapping:
    """What a stage expects to differ from the checkpoint it starts from (glob patterns over names)."""

    fresh: tuple[str, ...] = ()  # the model's own new parameters: keep their initialisation when absent
    dropped: tuple[str, ...] = ()  # the checkpoint's parameters this model has no use for


def read_checkpoint(path: str | Path, prefer_ema: bool = True) -> CheckpointWeights:
    """Hyperparameters and model weights of a checkpoint: a sharded checkpoint directory, a run's
    checkpoints directory (its newest valid checkpoint), or a Lightning checkpoint file, read with
    ``weights_only=True``. Nothing is unpickled but tensors and plain containers. The EMA weights
    are taken when the checkpoint has them and ``prefer_ema``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir():
        return _read_sharded(path, prefer_ema)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a truncated or foreign file: name it, and say what was expected
        raise ValueError(f"{path}: not a readable Lightning checkpoint ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    state = checkpoint["state_dict"]
    use_ema = prefer_ema and any(name.startswith(EMA_PREFIX) for name in state)
    prefix = EMA_PREFIX if use_ema else MODEL_PREFIX
    weights = {name.removeprefix(prefix): value for name, value in state.items() if name.startswith(prefix)}
    if not weights:
        raise ValueError(f"{path}: no weights under '{MODEL_PREFIX}' (keys look like {next(iter(state), 'none')!r}); not a uma-lightning model")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    return CheckpointWeights(str(path), hparams, weights, use_ema, checkpoint.get("module_class"))


def _read_sharded(path: Path, prefer_ema: bool) -> CheckpointWeights:
    """The weights of a sharded checkpoint (``ShardedCheckpoint``), gathered whole on this process,
    whatever strategy and number of processes wrote it."""
    prefixes = (f"{MODEL}/{EMA_PREFIX}",) * prefer_ema + (f"{MODEL}/{MODEL_PREFIX}",)
    try:
        directory, prefix, tensors = read_weights(path, prefixes)
        trainer_state = read_state(directory)[TRAINER]
    except CheckpointError as err:
        raise ValueError(f"{err}; give a checkpoint directory, a run's checkpoints directory or a .ckpt file") from None
    hparams = decode(trainer_state.get("hyper_parameters"), {}) or {}
    module_class = (trainer_state.get("module") or {}).get("module_class")
    weights = {key.removeprefix(prefix): value for key, value in tensors.items()}
    return CheckpointWeights(str(directory), dict(hparams), weights, prefix.endswith(EMA_PREFIX), module_class)


def check_weights(target: dict[str, torch.Tensor], source: CheckpointWeights, mapping: KeyMapping = KeyMapping(), model_name: str = "the model") -> None:
    """Raise ValueError listing every key of ``target`` (a state dict, possibly on the meta device)
    and of the checkpoint that does not map: missing, unexpected, or of another shape."""
    matches = lambda name, patterns: any(fnmatch.fnmatchcase(name, p) for p in patterns)  # noqa: E731
    missing = sorted(n for n in target if n not in source.weights and not matches(n, mapping.fresh))
    unexpected = sorted(n for n in source.weights if n not in target and not matches(n, mapping.dropped))
    reshaped = sorted(
        f"{n} {tuple(source.weights[n].shape)} -> {tuple(target[n].shape)}"
        for n in target
        if n in source.weights and source.weights[n].shape != target[n].shape
    )
    if missing or unexpected or reshaped:
        hint = " (no names in common: another model family?)" if not set(target) & set(source.weights) else ""
        parts = [f"{label} {_listing(keys)}" for label, keys in
                 (("missing from the checkpoint:", missing), ("not in this model:", unexpected), ("shapes differ:", reshaped)) if keys]
        raise ValueError(f"{source.path}: cannot initialise {model_name} from it{hint}; " + "; ".join(parts))


def load_weights(model: nn.Module, source: CheckpointWeights, mapping: KeyMapping = KeyMapping()) -> None:
    """Copy ``source``'s weights into ``model`` by name; raise ValueError listing every key that does not map."""
    target = model.state_dict()
    check_weights(target, source, mapping, type(model).__name__)
    with torch.no_grad():
        for name, value in source.weights.items():
            if name in target:
                target[name].copy_(value)
    fresh = sorted(n for n in target if n not in source.weights)
    dropped = sorted(n for n in source.weights if n not in target)
    log.info(
        "initialised %s from %s (%s weights): %d tensors loaded, %d new (%s), %d dropped (%s)",
        type(model).__name__, source.path, "EMA" if source.ema else "raw", len(target) - len(fresh),
        len(fresh), _groups(fresh), len(dropped), _groups(dropped),
    )


def _listing(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _groups(names: list[str]) -> str:
    """Top-level module names of a list of parameter names, for a short log line."""
    return ", ".join(sorted({n.split(".")[0] for n in names})) or "none"
