"""Short, actionable messages for bad configs: which key or file, what was wrong, the close match.

jsonargparse reports problems as multi-line ``ArgumentError`` texts; this module recognises the
common ones (unknown key, wrong type, unknown class, missing file, unknown subcommand), locates
the config file that set the offending key, and suggests the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import typing
from pathlib import Path

import yaml


class ConfigError(Exception):
    """A configuration problem, reported to the user as one short message (exit status 2)."""


_DEFAULT_CLASSES = {"model": "uma_lightning.modules.PretrainModule", "data": "uma_lightning.data.RobotDataModule"}


def explain(
    message: str, parser, args: list[str], tools: tuple[str, ...] = (), defaults: dict[str, str] | None = None
) -> str:
    """Rewrite a jsonargparse error message; ``args`` are the (include-expanded) command-line arguments,
    ``tools`` the subcommands dispatched outside LightningCLI, ``defaults`` the class paths of the
    model and data groups when none is given (their arguments are offered as close matches)."""
    located = _Locator(args)

    if match := re.search(r"invalid choice: '([^']+)' \(choose from (.+)\)", message):
        choices = re.findall(r"'([^']+)'", match.group(2)) + list(tools)
        return f"unknown command {match.group(1)!r}{did_you_mean(match.group(1), choices)} (commands: {', '.join(choices)})"

    if match := re.search(r"Group '([\w.]+)' does not accept option '([^']+)'", message):
        # A key of a dataclass section inside a section, e.g. model.network.vision.
        class_path = re.search(r"Problem with given class_path '([^']+)'", message)
        group, *nested = re.findall(r'Parser key "([^"]+)"', message) + match.group(1).split(".")
        name, section = match.group(2), ".".join([group, *nested])
        fields = _nested_fields(class_path.group(1), nested) if class_path else []
        return f"{located.where(f'{section}.{name}', name)}unknown key '{section}.{name}': {section} takes no key {name!r}{did_you_mean(name, fields)}"

    class_path = re.search(r"Problem with given class_path '([^']+)'", message)
    if class_path and (match := re.search(r"unrecognized arguments: --([\w.]+)", message)):
        # A key of a dataclass section of a class given by class_path, e.g. trainer.strategy.sizes.
        section, _, name = match.group(1).rpartition(".")
        owner, key = _parser_key(message), f"{_parser_key(message)}.{match.group(1)}"
        if fields := _nested_fields(class_path.group(1), section.split(".")) if section else []:
            return f"{located.where(key, name)}unknown key {key!r}: {owner}.{section} takes no key {name!r}{did_you_mean(name, fields)}"
        first = match.group(1).split(".")[0]
        return f"{located.where(key, name)}unknown key {key!r}: {owner} takes no argument {first!r}{did_you_mean(first, _init_params(class_path.group(1)))}"

    if match := re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"unrecognized arguments: --([\w.]+)", message
    ):
        key = match.group(1)
        group, *rest = [part for part in key.split(".") if part != "init_args"]
        if rest and (moved := _moved_to(group, rest[0], (defaults or _DEFAULT_CLASSES).get(group))):
            return f"{located.where(key)}{_moved_message(group, rest, moved)}"
        return f"{located.where(key)}unknown key {key!r}{did_you_mean(key, _known_keys(parser, args, defaults or _DEFAULT_CLASSES))}"

    if match := re.search(r'Parser key "config": File does not exist: \'([^\']+)\'', message):
        path = Path(match.group(1))
        siblings = [str(p) for p in path.parent.glob("*.y*ml")] if path.parent.is_dir() else []
        return f"config file not found: {path}{did_you_mean(str(path), siblings)}"

    lines = problem_lines(message)
    key = ".".join(re.findall(r'Parser key "([^"]+)"', message)) or "config"
    class_match = re.search(r"Problem with given class_path '([^']+)'", message)
    problem = re.sub(r"^Not of type \w+: ", "", lines[-1]) if lines else message.strip()
    if class_match:
        class_path = class_match.group(1)
        if option := re.search(r"Option '([^']+)' is not accepted", problem):
            name = option.group(1)
            nested = key.split(".")[1:]
            # A key of a dataclass argument, e.g. model.vision.
            if nested and (fields := _nested_fields(class_path, nested)):
                full = f"{key}.{name}"
                return f"{located.where(full, name)}unknown key {full!r}: {key} takes no key {name!r}{did_you_mean(name, fields)}"
            # An argument of the class given by class_path, at the top of a group (model) or deeper (trainer.strategy).
            full = f"{key}.init_args.{name}"
            if moved := _moved_to(key, name.split(".")[0], class_path):
                return f"{located.where(full, name)}{_moved_message(key, name.split('.'), moved)}"
            return (
                f"{located.where(full, name)}unknown key {full!r}: {class_path} takes no argument {name!r}"
                f"{did_you_mean(name, _init_params(class_path))}"
            )
        if re.search(r"(has no attribute|No module named|Unable to import|does not correspond)", problem):
            candidates = class_candidates(class_path)
            return f"{located.where(key, value=class_path)}{key}: unknown class {class_path!r}{did_you_mean(class_path, candidates)}"
    if named := re.search(r"Expected a dot import path string: (\S+)", problem):
        # A registered name (a strategy preset) with settings after it: only a class_path takes settings.
        return (
            f"{located.where(key)}{key}: {named.group(1)!r} is a registered name, which takes no settings; give a "
            f"class_path with them instead (e.g. a fragment of configs/, as configs/strategy/ has for each strategy)"
        )
    if expected := re.search(r"Expected a <class '([\w.]+)'>\. Got value: (.+)", problem):
        return f"{located.where(key)}{key}: expected {expected.group(1)}, got {expected.group(2)!r}"
    return f"{located.where(key)}{key}: {problem}"


def locate(args: list[str], key: str, value: str | None = None) -> str:
    """ "command line: ", "<config file>: " or "" for the last place in ``args`` that set ``key`` (or ``value``)."""
    return _Locator(args).where(key, value=value)


def _moved_to(group: str, name: str, class_path: str | None) -> str | None:
    """The new key of a setting that an earlier version took as ``group.name``, from the class's
    ``moved_settings`` (old argument name -> its key in a section), or None."""
    moved = getattr(import_dotted(class_path), "moved_settings", None) if class_path else None
    return f"{group}.{moved[name]}" if isinstance(moved, dict) and name in moved else None


def _moved_message(group: str, path: list[str], moved: str) -> str:
    """``path`` (the old key under ``group``, e.g. ["size"] or ["vision", "tokenizer"]) and where it is now."""
    old, new = ".".join([group, *path]), ".".join([moved, *path[1:]])
    return f"{old!r} is now {new!r}: settings are grouped in sections (see docs/guides/configuration.md)"


def problem_lines(message: str) -> list[str]:
    """The meaningful lines of a jsonargparse message, without its Union boilerplate."""
    boilerplate = (
        "Does not validate against any of the Union subtypes",
        "Subtypes:",
        "Errors:",
        "Given value",
        "Expected a <class 'NoneType'>",
        "Parser key",
        "Problem with given class_path",
    )
    # Nested Union errors list their causes as "- ..." items; judge each item by its text.
    stripped = (line.strip().removeprefix("- ") for line in message.splitlines())
    return [line for line in stripped if line and not line.startswith(boilerplate)]


def did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _parser_key(message: str) -> str:
    match = re.search(r'Parser key "([^"]+)"', message)
    return match.group(1) if match else "config"


def _subcommand_parser(parser, args: list[str]):
    action = getattr(parser, "_subcommands_action", None)
    if action is None:
        return parser
    name = next((a for a in args if a in action.choices), None)
    return action.choices.get(name, parser)


def _known_keys(parser, args: list[str], defaults: dict[str, str]) -> list[str]:
    sub = _subcommand_parser(parser, args)
    keys = [a.dest for a in sub._actions if a.dest not in ("help", "config")]
    # Subclass-mode groups (model, data) only know their init args once a class is chosen; offer
    # the arguments of the default classes too.
    for group, class_path in defaults.items():
        keys += [f"{group}.{p}" for p in _init_params(class_path)]
        keys += [f"{group}.init_args.{p}" for p in _init_params(class_path)]
    return keys


def _init_params(class_path: str) -> list[str]:
    cls = import_dotted(class_path)
    if cls is None:
        return []
    params = []
    for klass in inspect.getmro(cls):
        if "__init__" in vars(klass):
            params += [p for p in inspect.signature(klass.__init__).parameters if p not in ("self", "args", "kwargs")]
    return params


def _nested_fields(class_path: str, path: list[str]) -> list[str]:
    """Field names of the dataclass at ``path`` inside ``class_path``'s arguments (``["vision"]``), or []."""
    annotation = import_dotted(class_path)
    for name in path:
        hints = {}
        for klass in inspect.getmro(annotation) if inspect.isclass(annotation) else ():
            if "__init__" in vars(klass):
                hints = {**typing.get_type_hints(klass.__init__), **hints}
        annotation = next(
            (t for t in typing.get_args(hints.get(name)) or (hints.get(name),) if dataclasses.is_dataclass(t)), None
        )
        if annotation is None:
            return []
    return [field.name for field in dataclasses.fields(annotation)]


def class_candidates(class_path: str) -> list[str]:
    module_name, _, _ = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    return [f"{module_name}.{name}" for name, obj in vars(module).items() if inspect.isclass(obj)]


def import_dotted(class_path: str):
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None


class _Locator:
    """Finds which config file (or the command line) set a key, to point the user at it."""

    def __init__(self, args: list[str]):
        self.args = args
        self.files = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config" and Path(args[i + 1]).is_file()]

    def where(self, key: str, leaf: str | None = None, value: str | None = None) -> str:
        """ "command line: ", "<file>: " or "" for the last place that set ``key`` (or ``leaf``, or ``value``)."""
        on_command_line = [a for a in self.args if a.startswith("--") and a != "--config"]
        if (
            any(a.startswith(f"--{key}") for a in on_command_line)
            or (leaf and any(a.endswith(f".{leaf}") for a in on_command_line))
            or (value and value in self.args)
        ):
            return "command line: "
        for path in reversed(self.files):
            text = Path(path).read_text()
            keys = _flat_keys(yaml.safe_load(text) or {})
            if key in keys or (leaf and any(k.endswith(f".{leaf}") for k in keys)) or (value and value in text):
                return f"{path}: "
        return ""


def _flat_keys(tree, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(tree, dict):
        for name, value in tree.items():
            full = f"{prefix}{name}"
            keys.add(full)
            keys |= _flat_keys(value, f"{full}.")
            # "model: {class_path, init_args: {lr}}" is also addressable as "model.lr".
            if name == "init_args":
                keys |= _flat_keys(value, prefix)
    return keys
