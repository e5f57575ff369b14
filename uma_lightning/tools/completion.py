"""``uma completion bash|zsh``: a shell completion script for every subcommand, config key and preset.

    eval "$(uma completion bash)"                  # in ~/.bashrc
    uma completion zsh > "${fpath[1]}/_uma"        # or, after compinit: source <(uma completion zsh)

The script is generated from the parsers themselves (LightningCLI's for the training subcommands,
each tool's ``build_parser()``) and holds every word it offers, so a <TAB> runs no Python. Keys of
the model and data groups come from the constructors of this package's classes those groups accept
(their dataclass sections key by key, as ``--model.network.size``); ``--trainer.strategy`` offers
the strategy presets, ``--model.network.size`` the size presets. Generate it again after an upgrade.

jsonargparse's own shtab output knows neither the tools nor the model's keys, and argcomplete
runs Python on every <TAB>, which takes seconds to import torch and Lightning.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import shlex
import types
import typing
from dataclasses import dataclass, field

from uma_lightning.cli import UmaCLI, subcommand_parsers
from uma_lightning.models.sizes import ModelSize, preset_names
from uma_lightning.parallel.strategy import PRESETS
from uma_lightning.subcommands import TOOLS

# Tools that read a recipe and take its keys after their own options (parse_known_args).
RECIPE_TOOLS = ("plan", "parity")
# Options whose value is a file: the shell completes a path.
FILE_OPTIONS = ("-c", "--config")


@dataclass
class Command:
    """What may follow a command (``uma``, ``uma data``, ``uma fit``) on the command line."""

    options: list[str] = field(default_factory=list)
    values: dict[str, list[str]] = field(default_factory=dict)  # option -> the values it takes
    subcommands: dict[str, Command] = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uma completion", description="Print the shell completion script for uma.")
    parser.add_argument("shell", choices=("bash", "zsh"))
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    print(script(uma_commands(), args.shell))
    return 0


def uma_commands() -> Command:
    """Every subcommand of ``uma`` with its options and their known values."""
    training = UmaCLI.build_parser()
    root = Command(options=["--help", "--version"])
    for name, parser in subcommand_parsers(training).items():
        root.subcommands[name] = _training_command(parser, UmaCLI)
    recipe_keys = root.subcommands["fit"]
    for name, (target, _) in TOOLS.items():
        module = importlib.import_module(target.split(":")[0])
        if name == "rl":  # the fit subcommand over the RL learner and its rollouts
            command = _training_command(module.build_parser(), module.RLCLI)
        else:
            command = _command(module.build_parser())
        if name in RECIPE_TOOLS:
            command.options += [option for option in recipe_keys.options if option not in command.options]
            command.values = {**recipe_keys.values, **command.values}
        root.subcommands[name] = command
    return root


def _command(parser: argparse.ArgumentParser) -> Command:
    command = Command()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:  # hidden on purpose, as the recipes' `include`
            continue
        if isinstance(action, argparse._SubParsersAction):
            command.subcommands = {name: _command(sub) for name, sub in action.choices.items()}
            continue
        if not action.option_strings and action.choices:  # a positional argument of a few words, as bash|zsh
            command.subcommands.update({str(choice): Command() for choice in action.choices})
        command.options += [option for option in action.option_strings if option != "-h"]
        if action.option_strings and action.choices and action.nargs != 0:
            for option in action.option_strings:
                command.values[option] = [str(choice) for choice in action.choices]
    return command


def _training_command(parser, cli_class: type[UmaCLI]) -> Command:
    """A LightningCLI subcommand: its parser's keys, and those of every model and data class it accepts."""
    command = _command(parser)
    command.options = [option for option in command.options if not option.endswith(".help")]
    for group, base in (("model", cli_class.model_class), ("data", cli_class.datamodule_class)):
        classes = _concrete_subclasses(base)
        command.values[f"--{group}"] = sorted({cls.__name__ for cls in classes})
        # Set from the data module, not from the config.
        linked = tuple(f"model.{argument}" for argument in cli_class.data_links) if group == "model" else ()
        for cls in classes:
            for key, values in _init_keys(cls, group).items():
                if any(key == target or key.startswith(f"{target}.") for target in linked):
                    continue
                if f"--{key}" not in command.options:
                    command.options.append(f"--{key}")
                if values:
                    command.values[f"--{key}"] = values
    command.values["--trainer.strategy"] = ["auto", *PRESETS]
    return command


def _concrete_subclasses(base: type) -> list[type]:
    """The package's own concrete subclasses of ``base``: the script is the same whatever else the
    generating process has imported (a test's or a notebook's subclasses)."""
    found, pending = [], [base]
    while pending:
        cls = pending.pop(0)
        if not inspect.isabstract(cls) and cls not in found and cls.__module__.startswith("uma_lightning."):
            found.append(cls)
        pending += cls.__subclasses__()
    return found


def _init_keys(cls: type, prefix: str) -> dict[str, list[str]]:
    """``prefix.name`` for each constructor argument of ``cls`` (its bases' too), and
    ``prefix.name.field`` for each field of an argument that is a dataclass, with the values a key
    takes where they are few and known (presets, literals, enums, booleans)."""
    keys: dict[str, list[str]] = {}
    for klass in inspect.getmro(cls):
        if "__init__" not in vars(klass) or klass.__module__.startswith(("lightning.", "torch.", "builtins")):
            continue
        try:
            hints = typing.get_type_hints(klass.__init__)
        except (NameError, TypeError):  # an annotation that does not resolve here: its names alone
            hints = {}
        for name, parameter in inspect.signature(klass.__init__).parameters.items():
            if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            keys.update(_keys_of(f"{prefix}.{name}", hints.get(name)))
    return keys


def _keys_of(key: str, annotation) -> dict[str, list[str]]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = [arg for arg in typing.get_args(annotation) if arg is not type(None)] if union else [annotation]
    keys = {key: _values_of(options)}
    for option in options:
        if dataclasses.is_dataclass(option):
            hints = typing.get_type_hints(option)
            for each in dataclasses.fields(option):
                keys.update(_keys_of(f"{key}.{each.name}", hints.get(each.name)))
    return keys


def _values_of(options: list) -> list[str]:
    values: list[str] = []
    for option in options:
        if option is ModelSize:
            values += preset_names()
        elif option is bool:
            values += ["true", "false"]
        elif typing.get_origin(option) is typing.Literal:
            values += [str(value) for value in typing.get_args(option)]
        elif inspect.isclass(option) and issubclass(option, enum.Enum):
            values += [member.name for member in option]
    return values


# ---- the scripts ---------------------------------------------------------------------------------

# Shared by bash and zsh: POSIX functions over the command tree, each printing words.
_FUNCTIONS = """\
_uma_subcommands() {{  # $1: a command, as "uma data"
  case "$1" in
{subcommands}
  esac
}}
_uma_options() {{
  case "$1" in
{options}
  esac
}}
_uma_values() {{  # $1: a command, $2: the option before the cursor
  case "$1 $2" in
{values}
  esac
}}
_uma_command() {{  # the command the words before the cursor name: "uma", "uma data", ...
  local command=uma word
  for word in "$@"; do
    case "$word" in -*) continue ;; esac
    case " $(_uma_subcommands "$command") " in *" $word "*) command="$command $word" ;; esac
  done
  echo "$command"
}}
_uma_takes_file() {{
  case "$1" in {file_options}) return 0 ;; esac
  return 1
}}
"""

_BASH = """\
# bash completion for uma: eval "$(uma completion bash)"
{functions}
_uma() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}} before=$((COMP_CWORD - 1))
  # bash splits --key=value at the '=' (COMP_WORDBREAKS): complete the value of --key.
  if [[ $cur == "=" ]]; then cur=""; before=$((COMP_CWORD - 1))
  elif [[ $prev == "=" ]]; then prev=${{COMP_WORDS[COMP_CWORD-2]}}; before=$((COMP_CWORD - 2))
  fi
  local command values
  command=$(_uma_command "${{COMP_WORDS[@]:1:before}}")
  if _uma_takes_file "$prev"; then COMPREPLY=($(compgen -f -- "$cur")); return; fi
  values=$(_uma_values "$command" "$prev")
  if [[ -n $values ]]; then COMPREPLY=($(compgen -W "$values" -- "$cur")); return; fi
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$(_uma_options "$command")" -- "$cur"))
  else
    COMPREPLY=($(compgen -W "$(_uma_subcommands "$command")" -- "$cur"))
  fi
}}
complete -o default -o bashdefault -F _uma uma
"""

_ZSH = """\
#compdef uma
# zsh completion for uma: uma completion zsh > "${{fpath[1]}}/_uma", or after compinit: source <(uma completion zsh)
{functions}
_uma() {{
  local cur=${{words[CURRENT]}} prev=${{words[CURRENT-1]}} prefix=""
  if [[ $cur == --*=* ]]; then prev=${{cur%%=*}}; prefix="$prev="; cur=${{cur#*=}}; fi
  local command=$(_uma_command "${{(@)words[2,CURRENT-1]}}")
  if _uma_takes_file "$prev"; then _files; return; fi
  local values=$(_uma_values "$command" "$prev")
  if [[ -n $values ]]; then compadd -P "$prefix" -- ${{=values}}; return; fi
  if [[ $cur == -* ]]; then
    compadd -- ${{=$(_uma_options "$command")}}
  else
    local subcommands=$(_uma_subcommands "$command")
    if [[ -n $subcommands ]]; then compadd -- ${{=subcommands}}; else _files; fi
  fi
}}
if [[ $zsh_eval_context[-1] == loadautofunc ]]; then _uma "$@"; else compdef _uma uma; fi
"""


def script(root: Command, shell: str) -> str:
    """The completion script of ``root`` for ``shell`` (bash or zsh)."""
    subcommands, options, values = {}, {}, {}
    for name, command in _walk("uma", root):
        if command.subcommands:
            subcommands[name] = " ".join(command.subcommands)
        if command.options:
            options[name] = " ".join(command.options)
        for option, words in command.values.items():
            values[f"{name} {option}"] = " ".join(words)
    functions = _FUNCTIONS.format(
        subcommands=_cases(subcommands),
        options=_cases(options),
        values=_cases(values),
        file_options="|".join(FILE_OPTIONS),
    )
    return (_BASH if shell == "bash" else _ZSH).format(functions=functions.rstrip())


def _walk(name: str, command: Command):
    yield name, command
    for sub, child in command.subcommands.items():
        yield from _walk(f"{name} {sub}", child)


def _cases(words_of: dict[str, str]) -> str:
    """``case`` branches printing each entry's words, one branch for all entries with the same words."""
    patterns: dict[str, list[str]] = {}
    for name, words in words_of.items():
        patterns.setdefault(words, []).append(shlex.quote(name))
    return "\n".join(f"    {'|'.join(names)}) echo {shlex.quote(words)} ;;" for words, names in patterns.items())
