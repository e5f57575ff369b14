"""Run names a person can tell apart: what was run, what differs from its recipe, and a short
suffix that keeps two runs of the same command apart.

MLflow's own names (``overjoyed-slug-911``) are drawn from Python's ``random``, which
``seed_everything`` has seeded by then, so every run with the same seed got the same name.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Optional

MAX_NAME_LENGTH = 120  # the runs table shows about this much; the full list is the `overrides` tag
MAX_VALUE_LENGTH = 24  # a JSON list or a long path would crowd out the other settings
# How the config was given and where the run is logged, not what it runs.
IGNORED = ("config", "include", "trainer.logger")


def changed_settings(recipe: dict, resolved: dict, args: list[str] = ()) -> dict[str, Any]:
    """The leaves of ``resolved`` whose values differ from ``recipe`` (both nested dicts), by dotted
    key without the ``init_args`` level: those set by a command-line flag in ``args`` first, in
    the flags' order, then the others in config order."""
    old, new = _leaves(recipe), _leaves(resolved)
    changed = [key for key, value in new.items() if not _under(key, IGNORED) and old.get(key, _MISSING) != value]
    flags = [arg[2:].split("=", 1)[0].replace(".init_args", "") for arg in args if arg.startswith("--")]

    def position(key: str) -> int:
        return next((index for index, flag in enumerate(flags) if _under(key, (flag,))), len(flags))

    return {key: new[key] for key in sorted(changed, key=position)}


def describe_overrides(changed: dict[str, Any]) -> str:
    """``lr=1e-3 max_steps=40``: each changed setting under the shortest tail of its key that no
    other changed setting shares."""
    return " ".join(_settings(changed))


def run_name(
    recipe: Optional[str], stage: str, subcommand: str, changed: dict[str, Any], extra_configs: tuple[str, ...] = ()
) -> str:
    """``pretrain strategy=fsdp lr=1e-3 max_steps=40 #3f9a2c``: the recipe (and the stage when the
    recipe's name does not say it), the subcommand unless it is fit, extra config files as ``+name``,
    the changed settings (``changed_settings``), and six hex digits from the OS's random source.

    Within ``MAX_NAME_LENGTH``: the strategy's settings come first, as runs of one command on
    different strategies differ there; each value is cut to ``MAX_VALUE_LENGTH``; settings that do
    not fit are left out whole, counted as ``(+N more)``, rather than the name cut mid-setting."""
    what = Path(recipe).stem if recipe else stage
    if stage not in what:
        what += f" ({stage})"
    head = " ".join(
        [what, *([] if subcommand == "fit" else [subcommand]), *(f"+{Path(c).stem}" for c in extra_configs)]
    )
    keys = list(changed)
    settings = _settings(changed, max_value_length=MAX_VALUE_LENGTH)
    ordered = [setting for key, setting in zip(keys, settings) if _under(key, ("trainer.strategy",))]
    ordered += [setting for key, setting in zip(keys, settings) if not _under(key, ("trainer.strategy",))]
    body = " ".join([head, *ordered])
    left_out = 0
    if len(body) > MAX_NAME_LENGTH:
        # Room for the count of what is left out, at its widest.
        room = MAX_NAME_LENGTH - len(_more(len(ordered)))
        body = head
        for setting in ordered:
            if len(body) + 1 + len(setting) <= room:
                body += f" {setting}"
            else:
                left_out += 1
    return f"{body}{_more(left_out)} #{secrets.token_hex(3)}"


def _more(left_out: int) -> str:
    return f" (+{left_out} more)" if left_out else ""


def _settings(changed: dict[str, Any], max_value_length: Optional[int] = None) -> list[str]:
    keys = list(changed)
    settings = []
    for key in keys:
        value = format_value(changed[key])
        if max_value_length is not None and len(value) > max_value_length:
            value = value[: max_value_length - 1] + "…"
        settings.append(f"{_short_key(key, keys)}={value}")
    return settings


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        # 1e-3 rather than 0.001: learning rates and weight decays read as powers of ten.
        if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
            mantissa, exponent = f"{value:.6e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        value = os.fspath(value)
        # Paths by their last part: the run directory `runs/lr_sweep/a` reads as `a`.
        return Path(value).name if "/" in value.rstrip("/") else value
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, dict) and item for item in value):
        # A mixture or a callback list by each entry's first value: datasets=v21+v30.
        return "+".join(_entry_name(item) for item in value)
    if isinstance(value, (list, tuple)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


_MISSING = object()


def _entry_name(entry: dict) -> str:
    key, value = next(iter(entry.items()))
    return str(value).rsplit(".", 1)[-1] if key == "class_path" else format_value(value)


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
    if is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)
    elif callable(getattr(config, "to_dict", None)):  # a registered config type such as ModelSize
        config = config.to_dict()
    if not isinstance(config, dict) or not config:
        return {prefix: config}
    leaves = {}
    for key, value in config.items():
        path = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
        leaves.update(_leaves(value, path))
    return leaves


def _under(key: str, prefixes) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def _short_key(key: str, keys: list[str]) -> str:
    parts = key.split(".")
    for length in range(1, len(parts) + 1):
        tail = parts[-length:]
        if sum(1 for other in keys if other.split(".")[-length:] == tail) == 1:
            return ".".join(tail)
    return key
