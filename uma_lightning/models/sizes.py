"""Backbone size presets. Each preset is a YAML fragment in ``configs/model/<name>.yaml``."""

from __future__ import annotations

import dataclasses
import difflib
from importlib import resources
from pathlib import Path

import yaml

from uma_lightning.models.transformer import TransformerConfig

_PRESET_DIR = resources.files("uma_lightning.configs") / "model"


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in _PRESET_DIR.iterdir() if p.name.endswith(".yaml"))


class ModelSize:
    """A backbone size as a config value: built from a preset name, YAML path or dict, printed as full dimensions.

    The CLI registers it as a type, so ``--print_config`` and the saved config show every dimension.
    """

    def __init__(self, value: str | dict | TransformerConfig):
        self.config = load_size(value)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self.config)


def load_size(size: str | dict | TransformerConfig | ModelSize) -> TransformerConfig:
    """A backbone config from a preset name ("tiny"), a YAML file path, or a dict of dimensions.

    A dict may name a preset to start from and override some of its fields:
    ``{"name": "small", "n_layers": 6}`` is the small preset with 6 layers.
    """
    if isinstance(size, ModelSize):
        return size.config
    if isinstance(size, TransformerConfig):
        return size
    if isinstance(size, str):
        if size.endswith((".yaml", ".yml")):
            return _from_dict(_read_yaml(Path(size)), source=size)
        if size not in preset_names():
            close = difflib.get_close_matches(size, preset_names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown model size {size!r}{hint} (presets: {', '.join(preset_names())}, or a YAML path)"
            )
        return _from_dict(
            {**_read_yaml(_PRESET_DIR / f"{size}.yaml"), "name": size}, source=f"configs/model/{size}.yaml"
        )
    if isinstance(size, dict):
        base = size.get("name")
        fields = dict(size)
        if base in preset_names():
            fields = {**dataclasses.asdict(load_size(base)), **size}
        return _from_dict(fields, source="model size")
    raise TypeError(f"model size must be a preset name, a YAML path or a dict, got {type(size).__name__}")


def _read_yaml(path) -> dict:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model size file not found: {path}") from None


def _from_dict(fields: dict, source: str) -> TransformerConfig:
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source}: unknown model size key(s) {unknown}; known keys: {sorted(known)}")
    return TransformerConfig(**fields)
