"""``uma``'s training subcommands (fit, validate, test, predict): LightningCLI over recipes. The command
itself, its help and its tools, is ``uma_lightning.command``.

A recipe is a LightningCLI config that may list fragments to compose, first to last, before its
own keys:

    include:
      - ../configs/trainer/default.yaml
      - ../configs/tracking/mlflow.yaml
    trainer:
      max_steps: 300

Paths are relative to the file that includes them. ``uma fit --config R`` becomes
``--config <fragments of R> --config R``, so LightningCLI merges them as it merges repeated
``--config`` flags, and any key can still be overridden on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import typing
from argparse import SUPPRESS, ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import yaml
from jsonargparse.typing import register_type
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from uma_lightning.callbacks import TrainingHalted
from uma_lightning.callbacks.checkpointing import ShardedCheckpoint
from uma_lightning.callbacks.closed_loop import ClosedLoopEval
from uma_lightning.callbacks.preemption import Preempted
from uma_lightning.checkpoint import CheckpointError, RunFinished
from uma_lightning.cli_errors import (
    ConfigError,
    class_candidates,
    did_you_mean,
    explain,
    import_dotted,
    locate,
    problem_lines,
)
from uma_lightning.data import RobotDataModule
from uma_lightning.data.dataset import BAD_DATA_ERRORS
from uma_lightning.data.lerobot import DatasetError
from uma_lightning.models.sizes import ModelSize
from uma_lightning.modules import StageModule
from uma_lightning.parallel import MeshStrategy, register_strategies
from uma_lightning.parallel.strategy import PRESETS
from uma_lightning.subcommands import TOOLS
from uma_lightning.tracking import MLflowLogger, RecordRunConfig
from uma_lightning.tracking.run_name import changed_settings, describe_overrides, run_name

log = logging.getLogger("uma_lightning")

# How jsonargparse words the ValueError it raises from an exception inside a link's compute_fn.
_LINK_FAILURE = re.compile(r"Call to compute_fn of link '[^']*' with args")

register_type(ModelSize, serializer=ModelSize.to_dict, deserializer=ModelSize)


class _ParserBuilt(Exception):
    """Ends a command's construction once its parser is built (``UmaCLI.build_parser``)."""


class UmaCLI(LightningCLI):
    """LightningCLI over the stage modules (``StageModule`` subclasses) and ``RobotDataModule`` (or a subclass), by class_path."""

    model_class: type = StageModule
    datamodule_class: type = RobotDataModule
    # The model's constructor arguments that the data module supplies once it has read its metadata
    # (not config keys): the data's shapes, which the model is built for, and its normalisation,
    # kept in checkpoints so that inference undoes it without the dataset.
    data_links: dict[str, Callable] = {
        "spec": lambda data: data.spec,
        "normalization": lambda data: data.normalization(),
    }

    def __init__(self, args: Optional[list[str]] = None, run: bool = True):
        # The first config is the recipe; later ones (fragments such as configs/vision/grounded.yaml) add to it.
        configs = _configs_of(sys.argv[1:] if args is None else args)
        self.recipe, self.extra_configs = (configs[0], tuple(configs[1:])) if configs else (None, ())
        self.changed: dict = {}  # the settings the command line changes from its config files
        # Our names (fsdp_tp, pp, ...) and ours in place of Lightning's ddp and fsdp, for this command only:
        # importing the package leaves Lightning's registry alone.
        register_strategies()
        super().__init__(
            self.model_class,
            self.datamodule_class,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_callback=RecordRunConfig,
            save_config_kwargs={"overwrite": True, "recipe": self.recipe},
            parser_kwargs={"exit_on_error": False},
            args=args,
            run=run,
        )

    @classmethod
    def build_parser(cls):
        """The parser this command parses with, its subcommands' parsers included, built as a run builds
        it but without parsing arguments or building anything. LightningCLI has no call for that alone."""

        class ParserOnly(cls):
            def parse_arguments(self, parser, args) -> None:
                raise _ParserBuilt(parser)

        try:
            ParserOnly([])
        except _ParserBuilt as built:
            return built.args[0]
        raise AssertionError("LightningCLI built no parser")

    def parse_arguments(self, parser, args) -> None:
        args = expand_includes(sys.argv[1:] if args is None else list(args))
        try:
            self.config = parser.parse_args(args)
        except ArgumentError as err:
            defaults = {"model": _class_path(self.model_class), "data": _class_path(self.datamodule_class)}
            raise ConfigError(explain(str(err), parser, args, tools=tuple(TOOLS), defaults=defaults)) from None
        check_strategy(self.config, args)
        self.changed = self._changed_settings(parser, args)

    def _changed_settings(self, parser, args: list[str]) -> dict:
        """The settings the command line changes from its config files (``changed_settings``).
        Costs a second parse of the config files, so only for a run that is tracked."""
        subcommand = self.config.get("subcommand")
        resolved = self.config[subcommand] if subcommand else self.config
        if not resolved.get("trainer", {}).get("logger"):
            return {}
        files = [item for index, arg in enumerate(args[:-1]) if arg == "--config" for item in (arg, args[index + 1])]
        try:
            recipe = parser.parse_args(([subcommand] if subcommand else []) + files)
        except ArgumentError:
            return {}  # the files alone are incomplete; the command line completes them
        recipe = recipe[subcommand] if subcommand else recipe
        return changed_settings(recipe.as_dict(), resolved.as_dict(), args)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError, DatasetError) as err:
            # Raised by the configured classes' constructors or by a link between them: a config or
            # data problem, not a crash. jsonargparse wraps a link's exception in a message holding
            # the repr of its arguments; report the exception itself.
            while _LINK_FAILURE.match(str(err)) and err.__cause__ is not None:
                err = err.__cause__
            if isinstance(err, DatasetError):  # its message names the file and the key
                raise ConfigError(str(err)) from err
            raise ConfigError(f"bad value in config: {problem_lines(str(err))[0]}") from err
        for logger in self.trainer.loggers:
            if isinstance(logger, MLflowLogger):
                name = run_name(
                    self.recipe, _stage_of(self.model), self.subcommand or "fit", self.changed, self.extra_configs
                )
                logger.name_new_run(name, describe_overrides(self.changed))

    def add_arguments_to_parser(self, parser) -> None:
        # Consumed by expand_includes before parsing; hidden so printed configs stay fully resolved.
        parser.add_argument("--include", type=Optional[list[str]], default=None, help=SUPPRESS)
        for argument, compute in self.data_links.items():
            parser.link_arguments("data", f"model.init_args.{argument}", compute_fn=compute, apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        trainer = self.config[self.subcommand]["trainer"] if self.subcommand else self.config["trainer"]
        if trainer.get("precision") is None:
            trainer["precision"] = _default_precision()

    def before_fit(self) -> None:
        if isinstance(self.model, StageModule):  # `uma rl` learners start from their own checkpoints
            validates = self.trainer.limit_val_batches != 0 and getattr(self.datamodule, "val_episodes", True)
            closed_loop = any(isinstance(callback, ClosedLoopEval) for callback in self.trainer.callbacks)
            self.check_network_contract(
                ["training"]
                + (["validation (errors of predicted action chunks)"] if validates else [])
                + (["closed-loop evaluation"] if closed_loop else [])
            )
            try:
                self.model.check_init_from()
            except (ValueError, FileNotFoundError) as err:
                key = "model.init_from" if self.model.init_from else "model.network.pretrained"
                raise ConfigError(f"{key}: {err}") from None
        if isinstance(self.trainer.strategy, MeshStrategy):
            try:
                # Per process, so per data-parallel rank: what pipeline microbatches cut up.
                batch_size = getattr(getattr(self.datamodule, "hparams", None), "batch_size", None)
                self.trainer.strategy.check_module(self.model, batch_size)
            except ValueError as err:
                raise ConfigError(f"trainer.strategy: {err}") from None
        run_dir = Path(self.trainer.default_root_dir).resolve()
        for callback in self.trainer.checkpoint_callbacks:
            if callback.dirpath is None:
                callback.dirpath = str(run_dir / "checkpoints")
            if isinstance(callback, ShardedCheckpoint):
                # Before anything is written: RecordRunConfig's setup hook writes config.yaml and opens
                # a new MLflow run, or continues the checkpoints' run.
                callback.check_resumable(self.trainer, self.model, self.datamodule)
                callback.continue_tracked_run(self.trainer)
        log.info("run dir: %s", run_dir)

    def before_validate(self) -> None:
        self.check_network_contract(["validation (errors of predicted action chunks)"])

    def before_test(self) -> None:
        self.check_network_contract(["test (errors of predicted action chunks)"])

    def before_predict(self) -> None:
        self.check_network_contract(["prediction"])

    def check_network_contract(self, features: list[str]) -> None:
        """Stop the run before its first step where the network lacks a piece that one of the run's
        ``features`` calls (the model contract, ``models/contract.py``), in one line naming the piece
        and the feature; say once which optional feature is off for this network."""
        if not isinstance(self.model, StageModule):
            return
        optional = ["Policy (Policy.from_checkpoint, uma predict, RL actors)", "tokens per second"]
        problems = self.model.network_problems(features + optional)
        missing = [
            f"{problem}, which {' and '.join(needed)} {'needs' if len(needed) == 1 else 'need'}"
            for problem, needed_by in problems.items()
            if (needed := [feature for feature in needed_by if feature in features])
        ]
        if missing:
            raise ConfigError(f"model: {'; '.join(missing)} (see 'The model contract' in docs/guides/evaluation.md)")
        for problem, needed_by in problems.items():
            log.info("%s: off for this network (%s)", " and ".join(needed_by), problem)


def subcommand_parsers(parser) -> dict:
    """The parsers of ``parser``'s subcommands, by name (none for a tool's parser without subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve_recipe(config: str, overrides: list[str], cli_class: type[UmaCLI] = UmaCLI) -> UmaCLI:
    """The recipe and its overrides resolved and instantiated as ``uma fit`` would, without training:
    one process, no logger. Tools that read a recipe (``uma parity``, ``uma plan``) start here."""
    return cli_class(["--config", config, *overrides, "--trainer.logger", "false", "--trainer.devices", "1"], run=False)


def check_strategy(config, args: list[str]) -> None:
    """A strategy name Lightning does not know, or MeshStrategy sections that do not hold together, as
    a one-line ConfigError: checked after parsing, before the data module generates or reads anything
    (Lightning would find a wrong name only when the Trainer is built, with its generic message)."""
    subcommand = config.get("subcommand")
    strategy = (config[subcommand] if subcommand else config).get("trainer", {}).get("strategy")
    where = locate(args, "trainer.strategy", value=strategy if isinstance(strategy, str) else None)
    if isinstance(strategy, str):
        names = [*PRESETS, "auto", *(name for name in StrategyRegistry.available_strategies() if name not in PRESETS)]
        if strategy.lower() not in names:
            close = names + (class_candidates(strategy) if "." in strategy else [])  # a class path that did not import
            raise ConfigError(
                f"{where}trainer.strategy: unknown strategy {strategy!r}{did_you_mean(strategy, close)} (presets: "
                f"{', '.join(PRESETS)}; or auto, another of Lightning's registered names, or a class_path)"
            )
        return
    class_path = getattr(strategy, "class_path", None)
    strategy_class = import_dotted(class_path) if class_path else None
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, MeshStrategy)):
        return
    # jsonargparse builds the sections only with the strategy, after the data module.
    for name, section in typing.get_type_hints(strategy_class.__init__).items():
        given = strategy.init_args.get(name) if dataclasses.is_dataclass(section) else None
        if given is not None and not isinstance(given, section):
            try:
                section(**given.as_dict())
            except ValueError as err:
                raise ConfigError(f"{where}trainer.strategy: {err}") from None


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _default_precision() -> str:
    """bf16 autocast with fp32 master weights where the device has fast bf16, else full fp32."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        choice, why = "bf16-mixed", f"{torch.cuda.get_device_name()} supports bf16"
    else:
        choice, why = "32-true", "no bf16-capable GPU; CPU autocast to bf16 is slower than fp32 on most CPUs"
    log.info("precision: %s (%s)", choice, why)
    return choice


def _threads_for_slurm_task() -> None:
    """One CPU thread per core Slurm gave the task. Slurm need not bind a task to its cores, and torch
    then starts a thread per core of the node: two 1-CPU jobs on a 2-core node ran 30 times slower
    than one. Lightning sets threads only for processes it launches itself; OMP_NUM_THREADS wins."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, min(int(cpus), len(os.sched_getaffinity(0))))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the loader's workers and any process this one starts
    log.info("CPU threads: %d per process (SLURM_CPUS_PER_TASK=%s; set OMP_NUM_THREADS to override)", threads, cpus)


def expand_includes(args: list[str]) -> list[str]:
    """Replace each ``--config R`` by ``--config F1 ... --config Fn --config R`` for R's fragments."""
    expanded: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--config" and index + 1 < len(args):
            expanded += [item for path in _fragments(args[index + 1], chain=()) for item in ("--config", path)]
            index += 2
            continue
        if arg.startswith("--config="):
            expanded += [item for path in _fragments(arg.split("=", 1)[1], chain=()) for item in ("--config", path)]
        else:
            expanded.append(arg)
        index += 1
    return expanded


def _fragments(config: str, chain: tuple[str, ...]) -> list[str]:
    """``config`` preceded by everything it includes, depth first, in order."""
    path = Path(config)
    if not path.is_file():
        return [config]  # an inline YAML string, or a missing file that the parser will report
    resolved = str(path.resolve())
    if resolved in chain:
        raise ConfigError(f"{config}: include cycle: {' -> '.join(chain + (resolved,))}")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{config}: not valid YAML: {err}") from None
    includes = content.get("include") if isinstance(content, dict) else None
    if includes is None:
        return [config]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{config}: 'include' must be a list of file paths, got {includes!r}")
    out = []
    for include in includes:
        target = path.parent / include
        if not target.is_file():
            raise ConfigError(f"{config}: included file not found: {include} (looked for {target})")
        out += _fragments(str(target), chain + (resolved,))
    return out + [config]


def _configs_of(args: list[str]) -> list[str]:
    configs = []
    for index, arg in enumerate(args):
        if arg == "--config" and index + 1 < len(args):
            configs.append(args[index + 1])
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
    return configs


def _stage_of(model) -> str:
    """``pretrain`` for a PretrainModule or a research subclass of it: the first of this package's
    classes in the model's ancestry, without its Module/Learner ending."""
    cls = next((c for c in type(model).__mro__ if c.__module__.startswith("uma_lightning.")), type(model))
    return cls.__name__.removesuffix("Module").removesuffix("Learner").lower()


def bad_data_message(error: Exception) -> str:
    """The message of a dataset or video error. One raised in a DataLoader worker reaches this
    process re-raised by torch as the same class around "Caught X in DataLoader worker process N.",
    the worker's whole traceback, and last "module.X: message": the message is that last line."""
    text = str(error)
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return text
    last = text.rstrip().rsplit("\n", 1)[-1]
    cls = type(error)
    return last.removeprefix(f"{cls.__module__}.{cls.__qualname__}: ")


def train(args: list[str]) -> None:
    """Run a training subcommand (``uma fit ...``); a failure the user can fix ends with one line and status 2."""
    _threads_for_slurm_task()
    try:
        UmaCLI(args)
    except (ConfigError, CheckpointError) as err:  # each names the file, key or value at fault
        print(f"uma: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except BAD_DATA_ERRORS as err:  # a file found unreadable mid-run, by a loader worker or this process
        print(f"uma: error: {bad_data_message(err)}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunFinished as finished:  # nothing to do is not an error
        print(f"uma: {finished}", file=sys.stderr)
        raise SystemExit(0) from None
    except TrainingHalted as err:
        print(f"uma: training halted: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except Preempted as stop:
        stop.finish()  # the trainer has torn down: requeue if asked, exit 128 + signal


if __name__ == "__main__":  # the command moved: say where, rather than import everything and do nothing
    raise SystemExit("uma: run `uma ...` or `python -m uma_lightning.command ...`; uma_lightning.cli is not a command")
