"""Reading a checkpoint's weights and settings, and starting a model from them, without Lightning:
what ``init_from`` (a stage starting from an earlier stage's checkpoint) and ``Policy.from_checkpoint`` use.

Parameter names do not depend on how the checkpoint was trained (strategy, world size, wrappers),
so mapping is by name: a key the new model lacks, a key the checkpoint lacks, or a shape that
differs is an error listing the keys, unless the stage declares it (an action head it replaces,
a new module it trains from scratch).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from uma_lightning.checkpoint.codec import decode
from uma_lightning.checkpoint.manifest import CheckpointError, verify
from uma_lightning.checkpoint.resume import choose_checkpoint
from uma_lightning.checkpoint.storage import empty_like_saved, load_tensors, tensor_metadata
from uma_lightning.progress import Progress

log = logging.getLogger("uma_lightning")

# The parts of a sharded checkpoint (see ``state.py``).
STATE_FILE = "state.json"
MODEL, OPTIMIZER, TRAINER, RNG = "model", "optimizer", "trainer", "rng"

MODEL_PREFIX = "model."
EMA_PREFIX = "ema_model."


@dataclass(frozen=True)
class CheckpointWeights:
    path: str
    hparams: dict
    weights: dict[str, torch.Tensor]  # names inside the LightningModule's ``model``
    ema: bool  # the weights are the exponential moving average
    module_class: str | None  # the LightningModule that wrote the checkpoint, as "package.module.Class"
    network_builder: str | None = None  # "module:function" building its network from ``hparams`` (models/network.py)


@dataclass(frozen=True)
class KeyMapping:
    """What a stage expects to differ from the checkpoint it starts from (glob patterns over names)."""

    fresh: tuple[str, ...] = ()  # the model's own new parameters: keep their initialisation when absent
    dropped: tuple[str, ...] = ()  # the checkpoint's parameters this model has no use for


def read_checkpoint(path: str | Path, prefer_ema: bool = True) -> CheckpointWeights:
    """Hyperparameters and model weights of a checkpoint: a sharded checkpoint directory, a run's
    checkpoints directory (its newest valid checkpoint), a Lightning checkpoint file, read with
    ``weights_only=True``, or a weights file from ``save_weights_file`` (``uma ckpt export``). Nothing
    is unpickled but tensors and plain containers. The EMA weights are taken when the checkpoint has
    them and ``prefer_ema`` (a weights file holds one set)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir():
        return _read_sharded(path, prefer_ema)
    if path.suffix == ".safetensors":
        return _read_weights_file(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a truncated or foreign file: name it, and say what was expected
        raise ValueError(
            f"{path}: not a readable Lightning checkpoint ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    state = checkpoint["state_dict"]
    use_ema = prefer_ema and any(name.startswith(EMA_PREFIX) for name in state)
    prefix = EMA_PREFIX if use_ema else MODEL_PREFIX
    weights = {name.removeprefix(prefix): value for name, value in state.items() if name.startswith(prefix)}
    if not weights:
        raise ValueError(
            f"{path}: no weights under '{MODEL_PREFIX}' (keys look like {next(iter(state), 'none')!r}); not a uma-lightning model"
        )
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    return CheckpointWeights(
        str(path), hparams, weights, use_ema, checkpoint.get("module_class"), checkpoint.get("network_builder")
    )


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
    weights = {key.removeprefix(prefix): value for key, value in tensors.items()}
    origin = network_origin(trainer_state)
    return CheckpointWeights(
        str(directory),
        dict(hparams),
        weights,
        prefix.endswith(EMA_PREFIX),
        origin["module_class"],
        origin["network_builder"],
    )


def network_origin(trainer_state: dict) -> dict[str, str | None]:
    """``module_class`` and ``network_builder`` of a sharded checkpoint's trainer state, from what the
    module's (and callbacks') on_save_checkpoint added: "hooks", or "module" in older checkpoints."""
    extras = trainer_state.get("hooks") or trainer_state.get("module") or {}
    return {"module_class": extras.get("module_class"), "network_builder": extras.get("network_builder")}


def save_weights_file(
    output: Path, weights: dict[str, torch.Tensor], hparams: dict, metadata: dict[str, str | None]
) -> None:
    """Write ``weights`` as one safetensors file, atomically, with the hyperparameters (as JSON) and
    ``metadata`` (``module_class`` and ``network_builder`` make it a checkpoint ``read_checkpoint``
    and ``Policy.from_checkpoint`` read; None values are left out)."""
    header = {key: value for key, value in metadata.items() if value is not None}
    header["hyper_parameters"] = json.dumps(hparams)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    save_file({key: value.contiguous() for key, value in weights.items()}, str(partial), metadata=header)
    os.replace(partial, output)


def _read_weights_file(path: Path) -> CheckpointWeights:
    try:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
        weights = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    if "hyper_parameters" not in metadata:
        raise ValueError(f"{path}: no hyper_parameters in its metadata; not a weights file from `uma ckpt export`")
    return CheckpointWeights(
        str(path),
        json.loads(metadata["hyper_parameters"]) or {},
        weights,
        metadata.get("ema") == "true",
        metadata.get("module_class"),
        metadata.get("network_builder"),
    )


def read_state(directory: Path) -> dict:
    try:
        return json.loads((directory / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{directory / STATE_FILE}: unreadable: {err}") from None


def read_weights(
    path: Path, prefixes: tuple[str, ...], show_progress: bool = False
) -> tuple[Path, str, dict[str, torch.Tensor]]:
    """(checkpoint directory, prefix, tensors) of the tensors under the first of ``prefixes`` (checkpoint
    keys such as ``"model/model."``) that has any, read whole on this process, however they were sharded.

    ``path`` is one checkpoint directory, or a run's checkpoints directory, which means its newest valid
    checkpoint. Raises CheckpointError when there is none, it is unusable, or no prefix matches.
    ``show_progress`` reports the bytes checksummed and read (``uma_lightning.progress``).
    """
    path = Path(path)
    directory = path if (path / "manifest.json").exists() else choose_checkpoint(path, show_progress=show_progress)
    if directory is None:
        raise CheckpointError(f"{path}: a directory without checkpoints")
    if directory == path:  # choose_checkpoint has verified the one it chose
        problems = verify(directory, show_progress=show_progress)
        if problems:
            raise CheckpointError(f"{directory} is unusable: {'; '.join(problems)}")
    entries = tensor_metadata(directory)
    prefix = next((p for p in prefixes if any(key.startswith(p) for key in entries)), None)
    if prefix is None:
        raise CheckpointError(
            f"{directory}: no tensors under {' or '.join(map(repr, prefixes))}; see `uma ckpt inspect {directory}` for the names"
        )
    tensors = {key: empty_like_saved(entry) for key, entry in entries.items() if key.startswith(prefix)}
    if show_progress:
        _load_in_parts(tensors, directory)
    else:
        load_tensors(tensors, directory, None, alone=True)
    return directory, prefix, tensors


def _load_in_parts(tensors: dict[str, torch.Tensor], directory: Path, parts: int = 20) -> None:
    """``load_tensors`` about a twentieth of the bytes at a time, reporting each: one call for
    multi-GB weights would show nothing until the end."""
    total = sum(tensor.nbytes for tensor in tensors.values())
    with Progress(total, f"read {directory.name}:", "B", byte_counts=True) as progress:
        part: dict[str, torch.Tensor] = {}
        part_bytes = 0
        for index, (key, tensor) in enumerate(tensors.items()):
            part[key] = tensor
            part_bytes += tensor.nbytes
            if part_bytes >= total / parts or index == len(tensors) - 1:
                load_tensors(part, directory, None, alone=True)
                progress.advance(part_bytes)
                part, part_bytes = {}, 0


def check_weights(
    target: dict[str, torch.Tensor],
    source: CheckpointWeights,
    mapping: KeyMapping = KeyMapping(),
    model_name: str = "the model",
) -> None:
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
        parts = [
            f"{label} {_listing(keys)}"
            for label, keys in (
                ("missing from the checkpoint:", missing),
                ("not in this model:", unexpected),
                ("shapes differ:", reshaped),
            )
            if keys
        ]
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
        type(model).__name__,
        source.path,
        "EMA" if source.ema else "raw",
        len(target) - len(fresh),
        len(fresh),
        _groups(fresh),
        len(dropped),
        _groups(dropped),
    )


def _listing(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _groups(names: list[str]) -> str:
    """Top-level module names of a list of parameter names, for a short log line."""
    return ", ".join(sorted({n.split(".")[0] for n in names})) or "none"
