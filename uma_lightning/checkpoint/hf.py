"""Hugging Face model directories (what ``transformers``' ``save_pretrained`` writes: ``config.json``,
safetensors weights in one file or in shards listed by an index, the tokenizer and processor files):
weights in, for ``init_from``, and out, for ``uma ckpt export --format hf``.

A network that holds a ``transformers`` model names where with ``hf_prefix``, the attribute path of
that model inside it ("" for the network itself). The safetensors keys are that model's
``state_dict()`` keys as ``save_pretrained`` writes them: through the family's checkpoint renamings,
and each tied weight once.

Loading streams: one shard file open at a time (memory-mapped), and from each tensor only the part
this process holds: the whole tensor into a plain parameter, this rank's block into a DTensor sharded
by FSDP or tensor parallelism. So a process holds at most its own parameters plus one shard file.
Parameters outside the prefix (an action head, a state projection) keep their initialisation.

Only a network holding a ``transformers`` model, and the export, bring ``transformers`` in.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from uma_lightning.checkpoint.storage import local_part
from uma_lightning.progress import Progress

log = logging.getLogger("uma_lightning")

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SavedTensor:
    file: str  # the shard file's name inside the directory
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HFDirectory:
    path: Path
    model_type: str | None  # config.json's, e.g. "paligemma"
    tensors: dict[str, SavedTensor]  # every saved tensor by name, from the shard headers alone

    def files(self) -> list[str]:
        return sorted({saved.file for saved in self.tensors.values()})


def is_hf_directory(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory: a ``config.json`` beside safetensors weights."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors"))


def read_hf_directory(path: str | Path) -> HFDirectory:
    """The config's model type and every tensor's file and shape, read from the headers only.
    Raises ValueError naming the file that is unreadable or missing."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / CONFIG_FILE}: unreadable ({err})") from None
    index = path / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
    else:
        files = sorted(file.name for file in path.glob("*.safetensors"))
    tensors: dict[str, SavedTensor] = {}
    for name in files:
        try:
            with safe_open(str(path / name), "pt") as file:
                for key in file.keys():
                    tensors[key] = SavedTensor(name, tuple(file.get_slice(key).get_shape()))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path / name}: not a readable safetensors file ({err})") from None
    return HFDirectory(path, config.get("model_type"), tensors)


def hf_prefix(model: nn.Module) -> str:
    """The attribute path of the ``transformers`` model inside ``model``; ValueError when it holds none."""
    prefix = getattr(model, "hf_prefix", None)
    if prefix is None:
        raise ValueError(
            f"{type(model).__name__} holds no Hugging Face model (it has no hf_prefix naming one), "
            "so it cannot start from a Hugging Face directory"
        )
    return prefix


def hf_source_directory(model: nn.Module) -> str | None:
    """The Hugging Face directory ``model``'s ``transformers`` model was built from: its config's
    ``name_or_path``, which ``AutoConfig.from_pretrained`` sets, when that is one; else None."""
    config = getattr(model.get_submodule(hf_prefix(model)), "config", None)
    candidate = getattr(config, "name_or_path", None)
    return str(Path(candidate).resolve()) if candidate and is_hf_directory(candidate) else None


def hf_targets(model: nn.Module, saved: HFDirectory) -> tuple[dict[str, torch.Tensor], dict[str, str], set[str]]:
    """The parameters and persistent buffers of ``model``'s ``transformers`` model (plain tensors or
    DTensors, as the strategy laid them out) by the name ``saved`` gives each, that name's name in
    ``model``, and the saved names of tied weights (an output projection sharing the input embedding):
    those appear once, under their first name, as ``save_pretrained`` writes them.

    A saved name is the model's own, or what transformers' checkpoint conversion renames it to when
    it saves (PaliGemma's file says ``language_model.model.*`` for ``model.language_model.*``)."""
    prefix = hf_prefix(model)
    held = model.get_submodule(prefix)
    start = f"{prefix}." if prefix else ""
    state = {
        name.removeprefix(start): tensor
        for name, tensor in model.state_dict(keep_vars=True).items()
        if name.startswith(start)
    }
    rename = _saved_name_of(held)
    saved_names = {name: rename(name) if rename(name) in saved.tensors else name for name in state}
    unique, tied = untied(state)
    targets = {saved_names[name]: tensor for name, tensor in unique.items()}
    return targets, {saved_names[name]: start + name for name in state}, {saved_names[name] for name in tied}


def _saved_name_of(held: nn.Module):
    """The function from a parameter name of a ``transformers`` model to the name its ``save_pretrained``
    writes (the identity for other modules): the model's checkpoint renamings, reversed. A conversion
    that changes tensors (fused or split weights) is refused: streaming copies tensors as they are."""
    if not hasattr(held, "config") or not hasattr(held, "save_pretrained"):
        return lambda name: name
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    conversions = getattr(held, "_weight_conversions", None) or [
        conversion
        for conversion in get_model_conversion_mapping(held, add_legacy=False)
        if not isinstance(conversion, PrefixChange)  # as save_pretrained does for a model built from a config
    ]
    reversed_ = [conversion.reverse_transform() for conversion in conversions[::-1]]
    converting = [conversion for conversion in reversed_ if not isinstance(conversion, WeightRenaming)]
    if converting:
        raise ValueError(
            f"{type(held).__name__} converts tensors when it loads ({type(converting[0]).__name__} of "
            f"{converting[0].source_patterns}); loading it shard by shard copies tensors as they are saved"
        )

    def saved_name(name: str) -> str:
        # Each renaming in turn (what transformers' own ``apply_renamings`` does; that helper is newer than 5.17).
        for renaming in reversed_:
            name, _ = renaming.rename_source_key(name)
        return name

    return saved_name


def untied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``state`` with each tensor under its first name only, and the other names (tied weights)."""
    seen: set[int] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor
    return unique, set(state) - set(unique)


def check_hf_weights(model: nn.Module, source: HFDirectory) -> None:
    """Raise a one-line ValueError naming the first key (and its file) that does not map between
    ``source`` and ``model``'s ``transformers`` model: another family, a missing key, an unexpected
    key, a shape that differs. ``model`` may be on the meta device."""
    prefix = hf_prefix(model)
    held = model.get_submodule(prefix)
    model_type = getattr(getattr(held, "config", None), "model_type", None)
    if model_type and source.model_type != model_type:
        raise ValueError(
            f"{source.path / CONFIG_FILE}: model_type {source.model_type!r}, but {type(model).__name__} holds a "
            f"{model_type!r} model (another family)"
        )
    targets, names, tied = hf_targets(model, source)
    problems = []
    missing = [key for key in targets if key not in source.tensors]
    if missing:
        problems.append(f"{_first(missing)} is missing from {source.path} (the model's {names[missing[0]]})")
    unexpected = [key for key in source.tensors if key not in targets and key not in tied]
    if unexpected:
        saved = source.tensors[unexpected[0]]
        problems.append(f"{_first(unexpected)} of {source.path / saved.file} is not in {type(model).__name__}")
    for key, target in targets.items():
        saved = source.tensors.get(key)
        if saved is not None and saved.shape != tuple(target.shape):
            problems.append(
                f"{key} of {source.path / saved.file} has shape {list(saved.shape)}, the model's "
                f"{names[key]} {list(target.shape)}"
            )
            break
    if problems:
        raise ValueError(f"{source.path}: cannot initialise {type(model).__name__} from it: " + "; ".join(problems))


def load_hf_weights(model: nn.Module, source: HFDirectory) -> None:
    """Copy ``source``'s weights into ``model``'s ``transformers`` model, one shard file at a time,
    each process reading only the block of each tensor it holds (``check_hf_weights`` first)."""
    check_hf_weights(model, source)
    targets, _, _ = hf_targets(model, source)
    sizes = {name: (source.path / name).stat().st_size for name in source.files()}
    with Progress(sum(sizes.values()), f"load {source.path.name}:", "B", byte_counts=True) as progress:
        for name in source.files():
            with safe_open(str(source.path / name), "pt") as file, torch.no_grad():
                for key in file.keys():
                    if key in targets:
                        _copy_into(targets[key], file.get_slice(key), key)
            progress.advance(sizes[name])
    log.info(
        "initialised %s from the Hugging Face model %s: %d tensors from %d files",
        type(model).__name__,
        source.path,
        len(targets),
        len(sizes),
    )


def materialise(model: nn.Module, device: torch.device | str) -> None:
    """Give the parameters ``model`` holds on the meta device (plain tensors or DTensors, as a strategy
    laid them out) this process's memory on ``device``, uninitialised until weights are loaded into
    them. The other parameters and the buffers keep their values; a ``transformers`` model's
    non-persistent buffers (rotary frequencies, position ids, embedding scales), which a build on the
    meta device leaves without values, get those its own initialisation computes from the config."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if not any(local_part(tensor).is_meta for _, tensor in tensors):
        return
    with torch.no_grad():
        kept = {name: local_part(tensor).clone() for name, tensor in tensors if not local_part(tensor).is_meta}
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        # In place: each parameter stays the same object, so tied weights stay tied and the references
        # FSDP keeps to its sharded parameters stay valid.
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to_empty(device=device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in kept:
                local_part(tensor).copy_(kept[name])
    if getattr(model, "hf_prefix", None) is not None:
        _init_computed_buffers(model.get_submodule(model.hf_prefix))


def load_pretrained(network: nn.Module, device: torch.device | str = "cpu") -> None:
    """``network`` (one holding a ``transformers`` model built from its config, with
    ``pretrained_weights()`` naming the directory) materialised on ``device`` with the pretrained
    weights: what a stage does after the strategy's layout, for a network used on its own."""
    materialise(network, device)
    load_hf_weights(network, read_hf_directory(network.pretrained_weights()))


def _init_computed_buffers(held: nn.Module) -> None:
    """Run the ``transformers`` initialisation of each module holding non-persistent buffers, with
    every parameter marked as initialised (transformers' initialisers then leave it as it is), so
    only the buffers are set: by the init of the nearest model class above the module, as
    ``from_pretrained`` sets the buffers of a model it built on the meta device."""
    if not hasattr(held, "_init_weights"):
        return
    owners = {}  # each module's nearest transformers model, the one whose _init_weights knows it
    for name, module in held.named_modules():
        owners[name] = module if hasattr(module, "_init_weights") else owners[name.rpartition(".")[0]]
    with torch.no_grad():
        for name, module in held.named_modules():
            if not module._non_persistent_buffers_set:
                continue
            for parameter in module.parameters():
                parameter._is_hf_initialized = True
            owners[name]._init_weights(module)
            for parameter in module.parameters():
                del parameter._is_hf_initialized


def _copy_into(target: torch.Tensor, saved, name: str) -> None:
    """Copy the part of a saved tensor (a safetensors slice, read lazily) that ``target`` holds: all
    of it, or a DTensor's local block (FSDP's or tensor parallelism's shard)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        target.copy_(saved[:])
        return
    local = target.to_local()
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"{name}: its layout {target.placements} holds no block of the tensor; it cannot be streamed")
    if local.numel():
        local.copy_(saved[tuple(slice(start, start + size) for start, size in zip(offset, shape))])


def _first(keys: list[str]) -> str:
    return keys[0] + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


# ---- out: a Hugging Face directory from one of our checkpoints -------------------------------------

#: What ``save_pretrained`` writes itself; every other file of the source directory (tokenizer,
#: processor, chat template) is copied as it is.
WRITTEN_BY_TRANSFORMERS = (CONFIG_FILE, INDEX_FILE, "generation_config.json")


def export_hf_directory(
    weights: dict[str, torch.Tensor], source: Path, output: Path, max_shard_size: str = "5GB"
) -> int:
    """Write ``weights`` (names of the ``transformers`` model) as a directory ``from_pretrained`` loads:
    the model class and config of ``source`` (its ``config.json``), the weights as safetensors shards,
    and ``source``'s tokenizer and processor files, all at once (renamed into place when written).
    Returns the number of tensors written. Raises ValueError naming a key that does not map to that
    model, or when ``output`` exists and is not empty."""
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"{output}: exists and is not empty; export to a new directory")
    from uma_lightning.models.vlm import import_transformers

    transformers = import_transformers()
    config = transformers.AutoConfig.from_pretrained(source)
    architecture = (config.architectures or [None])[0]
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise ValueError(f"{source / CONFIG_FILE}: names no transformers model class (architectures: {architecture})")
    with torch.device("meta"):
        model = model_class(config)
    expected, tied = untied(model.state_dict(keep_vars=True))
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected and key not in tied]
    if missing or unexpected:
        found = f"{_first(missing)} is missing" if missing else f"{_first(unexpected)} is not in {architecture}"
        raise ValueError(f"{source / CONFIG_FILE}: the checkpoint does not fit {architecture}: {found}")
    for key, tensor in expected.items():
        if tuple(weights[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{source / CONFIG_FILE}: {key} has shape {list(weights[key].shape)} in the checkpoint, "
                f"{list(tensor.shape)} in {architecture}"
            )
    model.load_state_dict({key: weights[key] for key in expected}, strict=False, assign=True)
    model.tie_weights()
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, max_shard_size=max_shard_size)
    for file in sorted(source.iterdir()):
        if file.is_file() and file.suffix != ".safetensors" and file.name not in WRITTEN_BY_TRANSFORMERS:
            shutil.copy2(file, staging / file.name)
    if output.exists():
        output.rmdir()  # empty, checked above
    os.replace(staging, output)
    return len(expected)
