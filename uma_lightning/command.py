"""The ``uma`` command: its help and versions, and the hand-over to a subcommand.

Training subcommands go to LightningCLI (``uma_lightning.cli``); tools to their own modules, each
imported only when called. Nothing here imports torch or Lightning at the top, so a tool that needs
neither (``uma report``, ``uma data info``) starts in a fraction of a second instead of the five
that importing Lightning takes, and ``uma --help`` too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import platform
import sys
import warnings
from typing import Optional

from uma_lightning.subcommands import TOOLS, TRAINING


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "--version"):
        command_parser().parse_args(args[:1])  # prints and exits
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _quiet_library_noise()
    if args[0] in TOOLS:
        module, function = TOOLS[args[0]][0].split(":")
        raise SystemExit(getattr(importlib.import_module(module), function)(args[1:]))
    from uma_lightning.cli import train

    train(args)


def command_parser() -> argparse.ArgumentParser:
    """``uma`` before its subcommand: every subcommand with one line, and the versions. Each
    subcommand's own parser takes over from there (LightningCLI's, or a tool's)."""
    tools = {name: line for name, (_, line) in TOOLS.items()}
    width = max(map(len, [*TRAINING, *tools]))

    def table(commands: dict[str, str]) -> str:
        return "\n".join(f"  {name:<{width}}  {line}" for name, line in commands.items())

    parser = argparse.ArgumentParser(
        prog="uma",
        usage="uma [-h] [--version] COMMAND ...",
        description="Train humanoid-robot foundation models, and the tools around training.",
        epilog=f"training (LightningCLI):\n{table(TRAINING)}\n\ntools:\n{table(tools)}\n\n"
        "`uma COMMAND --help` shows a command's own options; for training, every config key.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the tables' rows
    )
    parser.add_argument(
        "--version", action=_PrintVersions, nargs=0, help="print the versions of uma, torch and Lightning"
    )
    parser.add_argument("command", choices=[*TRAINING, *tools], metavar="COMMAND", help=argparse.SUPPRESS)
    return parser


class _PrintVersions(argparse.Action):
    """argparse's ``version`` action wants the text when the parser is built; the versions import torch
    and Lightning, which only ``--version`` needs."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


def versions() -> str:
    """uma-lightning's version and those of the libraries that decide how it trains."""
    import lightning
    import torch

    return (
        f"uma-lightning {importlib.metadata.version('uma-lightning')} (torch {torch.__version__}, "
        f"lightning {lightning.__version__}, Python {platform.python_version()})"
    )


def _quiet_library_noise() -> None:
    """Drop messages that say nothing about the run: an advert, and a deprecation inside Lightning."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage()
    )
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")


if __name__ == "__main__":
    main()
