"""``uma rl``: train an RL learner on a ``RolloutDataModule``, with the same recipes, overrides,
config errors, checkpoints and tracking as ``uma fit``.

    uma rl --config recipes/rl.yaml [--data.env InvertedPendulum-v5] [--print_config]

Running the same command again resumes from the run's last checkpoint when the recipe sets
``ckpt_path: last``.
"""

from __future__ import annotations

import sys
from typing import Optional

from uma_lightning.cli import UmaCLI, subcommand_parsers
from uma_lightning.cli_errors import ConfigError
from uma_lightning.rl.data import RolloutDataModule
from uma_lightning.rl.learner import RLLearner


class RLCLI(UmaCLI):
    """``UmaCLI`` over an ``RLLearner`` subclass and ``RolloutDataModule``; always the ``fit`` subcommand."""

    model_class = RLLearner
    datamodule_class = RolloutDataModule
    # The learner's networks are built for the environment's shapes, read by the data module.
    data_links = {"env": lambda data: data.env_spec}

    def __init__(self, args: Optional[list[str]] = None, run: bool = True):
        super().__init__(["fit", *(sys.argv[2:] if args is None else args)], run=run)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        # `uma rl` is the fit subcommand under its own name: its help and usage say `uma rl`.
        subcommand_parsers(self.parser)["fit"].prog = "uma rl"


def build_parser():
    """The parser ``uma rl`` parses with (``uma fit``'s keys over the learner and its rollouts)."""
    return subcommand_parsers(RLCLI.build_parser())["fit"]


def main(argv: list[str]) -> int:
    try:
        RLCLI(argv)
    except ConfigError as err:
        print(f"uma rl: error: {err}", file=sys.stderr)
        return 2
    return 0
