"""``uma parity``'s command line: the recipe resolved, its batches, the checks before any run, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

import torch

from uma_lightning.cli_errors import ConfigError
from uma_lightning.models.moe import moe_layers
from uma_lightning.parallel.apply import ParallelConfig
from uma_lightning.parallel.pipeline import PipelineConfig
from uma_lightning.tools.parity.layouts import LAYOUTS, PRECISIONS, data_parallel_size, needs_experts
from uma_lightning.tools.parity.precision import compare_precision, plot_precision, print_precision_report
from uma_lightning.tools.parity.report import print_report
from uma_lightning.tools.parity.runs import Case, check_parity


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uma parity",
        description="Does a recipe train the same under each strategy as on one process (or in low precision as in fp32)?",
        epilog="Other arguments override recipe keys, as in uma fit (e.g. --model.network.size tiny --data.batch_size 8).",
    )
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument(
        "--strategies",
        help=f"comma-separated, from {', '.join(LAYOUTS)} (default ddp,fsdp,tp; with --precision: one process)",
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="training steps, one global batch (data.batch_size samples) each"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="compare this precision with fp32, layer by layer, instead of strategies",
    )
    for name, section in STRATEGY_SECTIONS.items():
        add_section_options(parser, name, section)
    parser.add_argument("--report", help="also write the results as JSON to this file")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="with --precision: chart the worst layers' error, flagged ones in red"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds a group of processes may take")
    return parser


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    default = "" if args.precision else "ddp,fsdp,tp"
    strategies = [
        s.strip() for s in (args.strategies if args.strategies is not None else default).split(",") if s.strip()
    ]
    try:
        unknown = [s for s in strategies if s not in LAYOUTS]
        if unknown or not (strategies or args.precision):
            raise ConfigError(
                f"--strategies: unknown strategy {', '.join(unknown) or '(none given)'}; choose from {', '.join(LAYOUTS)}"
            )
        if args.plot and not args.precision:
            raise ConfigError("--plot: draws the per-layer error of --precision; give --precision too")
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        strategy_args = {name: section_of(args, name, section) for name, section in STRATEGY_SECTIONS.items()}
        module, batches, trainer_args = resolve(args.config, overrides, args.steps)
        check_batch_splits(len(batches[0]["sample_id"]), strategies, strategy_args["pipeline"].microbatches)
        check_experts(module, strategies)
    except ConfigError as err:
        print(f"uma parity: error: {err}", file=sys.stderr)
        return 2

    global_batch = len(batches[0]["sample_id"])
    if args.precision:
        results = {name or "one process": compare_precision(module, batches, trainer_args, args.precision, name and LAYOUTS[name], strategy_args, args.timeout)
                   for name in strategies or [None]}  # fmt: skip
        print_precision_report(args.config, args.precision, results, global_batch)
        if args.plot:
            try:
                plot_precision(args.plot, args.precision, results)
            except ImportError:
                print(
                    "uma parity: error: --plot: needs matplotlib (pip install matplotlib; mlflow installs it)",
                    file=sys.stderr,
                )
                return 2
        ok = all(r["ok"] for r in results.values())
    else:
        case = Case(args.config, module, batches, strategies, trainer_args, strategy_args)
        try:
            results = check_parity([case], args.timeout)[args.config]
        except ConfigError as err:
            print(f"uma parity: error: {err}", file=sys.stderr)
            return 2
        print_report(args.config, results, global_batch)
        ok = all(r["ok"] for r in results.values())
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


# The strategy runs' MeshStrategy sections besides the sizes (which LAYOUTS fixes), as --SECTION.FIELD options.
STRATEGY_SECTIONS = {"wrapping": ParallelConfig, "pipeline": PipelineConfig}


def add_section_options(parser: argparse.ArgumentParser, name: str, section: type) -> None:
    """``--NAME.FIELD`` for each setting of the dataclass ``section``, typed from its annotations; left
    unset unless given, so the dataclass's own defaults apply."""
    group = parser.add_argument_group(f"{name} ({section.__name__}, in the strategy runs)")
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        if not field.init:
            continue
        kind = hints[field.name]
        options: dict = {
            "dest": f"{name}.{field.name}",
            "default": argparse.SUPPRESS,
            "help": f"default {field.default}",
        }
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        else:
            # Optional[X]: X; a tuple of ints as comma-separated numbers.
            kind = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            options["type"] = comma_separated_ints if typing.get_origin(kind) is tuple else kind
        group.add_argument(f"--{name}.{field.name}", **options)


def comma_separated_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def section_of(args: argparse.Namespace, name: str, section: type):
    """The ``section`` dataclass from the ``--NAME.FIELD`` options given, or a one-line ConfigError."""
    given = {key.split(".", 1)[1]: value for key, value in vars(args).items() if key.startswith(f"{name}.")}
    try:
        return section(**given)
    except ValueError as err:
        raise ConfigError(f"--{err}") from None


def check_batch_splits(global_batch: int, strategies: list[str], pp_microbatches: int | None = None) -> None:
    for name in strategies:
        stages = LAYOUTS[name][1].pp
        parts = data_parallel_size(name) * (pp_microbatches or stages if stages > 1 else 1)
        if global_batch % parts:
            raise ConfigError(
                f"{name}: global batch {global_batch} (data.batch_size) does not split over {data_parallel_size(name)} data-parallel ranks"
                + (f" x {parts // data_parallel_size(name)} pipeline microbatches" if stages > 1 else "")
            )


def check_experts(module, strategies: list[str]) -> None:
    """The expert-parallel strategies need mixture-of-experts layers; the model is built on the meta device to look."""
    wanting = [name for name in strategies if needs_experts(name)]
    if wanting:
        with torch.device("meta"):
            model = module.build_model()
        if not moe_layers(model):
            raise ConfigError(
                f"{', '.join(wanting)}: the model has no mixture-of-experts layers to split (use a size with a moe: section, e.g. --model.network.size tiny_moe)"
            )


def resolve(config: str, overrides: list[str], steps: int):
    """The recipe's (not yet configured) LightningModule, its first ``steps`` training batches, and its gradient clipping."""
    from uma_lightning.cli import resolve_recipe

    cli = resolve_recipe(config, overrides)
    cli.datamodule.setup("fit")
    batches = []
    for batch in cli.datamodule.train_dataloader():
        batches.append(batch)
        if len(batches) == steps:
            break
    if len(batches) < steps:
        raise ConfigError(f"{config}: the training data has only {len(batches)} batches, fewer than --steps {steps}")
    trainer_args = {
        "gradient_clip_val": cli.trainer.gradient_clip_val,
        "gradient_clip_algorithm": cli.trainer.gradient_clip_algorithm,
    }
    return cli.model, batches, trainer_args


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
