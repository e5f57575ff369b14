"""The reference pages, generated from the code when the site is built (an mkdocs hook), so they
cannot drift from it: every ``uma`` subcommand's ``--help``, every config section's keys with their
defaults and descriptions, and every callback's docstring and arguments. The pictures the pages
show are drawn by the tools themselves, at build time too.

Keys and their descriptions are read as jsonargparse reads them for ``--help``: from the ``Args:``
section of a class's docstring (a dataclass section) or of its ``__init__`` docstring.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

# The config sections, in the order of the page: (key prefix, class path, what it is).
SECTIONS = [
    ("model.init_args", "uma_lightning.modules.PretrainModule", "pretraining (`recipes/pretrain.yaml`)"),
    ("model.init_args", "uma_lightning.modules.MidtrainModule", "mid-training (`recipes/midtrain.yaml`)"),
    ("model.init_args", "uma_lightning.modules.PosttrainModule", "post-training (`recipes/posttrain.yaml`)"),
    ("model.init_args.network", "uma_lightning.models.network.NetworkConfig", "the network, in every stage"),
    ("model.init_args.network.size", "uma_lightning.models.transformer.TransformerConfig", "a backbone size"),
    ("model.init_args.network.size.moe", "uma_lightning.models.moe.MoEConfig", "mixture-of-experts layers"),
    ("model.init_args.optimizer", "uma_lightning.modules.base.OptimizerConfig", "AdamW and its schedule"),
    ("model.init_args.expert", "uma_lightning.models.flow.ActionExpertConfig", "post-training's action expert"),
    ("model.init_args.flow", "uma_lightning.models.flow_matching.FlowMatchingConfig", "flow matching"),
    ("model.init_args.lora", "uma_lightning.models.lora.LoraConfig", "LoRA adapters"),
    ("data.init_args", "uma_lightning.data.RobotDataModule", "robot data for `uma fit`"),
    ("data.init_args.datasets[]", "uma_lightning.data.datamodule.DatasetSource", "one dataset of a mixture"),
    ("trainer.strategy.init_args", "uma_lightning.parallel.MeshStrategy", "the parallel layout"),
    ("trainer.logger.init_args", "uma_lightning.tracking.MLflowLogger", "MLflow tracking"),
    ("model.init_args", "uma_lightning.rl.PPOLearner", "`uma rl`: PPO"),
    ("model.init_args", "uma_lightning.rl.SACLearner", "`uma rl`: SAC"),
    ("data.init_args", "uma_lightning.rl.data.RolloutDataModule", "`uma rl`: actors and environments"),
]
# Keys that ``uma`` fills from the data module: not set by hand.
LINKED = {"spec", "normalization", "env"}
TRAINING_COMMANDS = ("fit", "validate", "test", "predict")


class Key(NamedTuple):
    section: str
    name: str
    type: str
    default: str
    description: str


def import_object(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def section_keys(cls) -> list[Key]:
    """Every key of ``cls``'s init arguments (nested dataclass sections expanded), as ``--help`` has them."""
    from jsonargparse import ArgumentParser
    from jsonargparse._typehints import ActionTypeHint

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x", sub_configs=True)
    keys = []
    for action in parser._actions:
        if not isinstance(action, ActionTypeHint):
            continue
        name = action.dest.removeprefix("x.")
        if name in LINKED:
            continue
        default = "required" if action.default is None and action.required else f"`{action.default!r}`"
        keys.append(
            Key(cls.__name__, name, type_name(action._typehint), default, " ".join((action.help or "").split()))
        )
    return keys


def type_name(hint) -> str:
    """``int``, ``Optional[str]``, ``Literal['a', 'b']``: a type as a reader writes it."""
    if isinstance(hint, type):
        return hint.__name__
    return re.sub(r"\b(typing|uma_lightning(\.\w+)*|datetime)\.", "", str(hint))


def all_keys() -> list[tuple[str, str, str, list[Key]]]:
    """(key prefix, class name, what it is, keys) for every section of ``SECTIONS``."""
    return [(prefix, path, what, section_keys(import_object(path))) for prefix, path, what in SECTIONS]


def config_page() -> str:
    out = [
        "# Configuration keys",
        "",
        "Generated from the code: each section's keys with their types, defaults and descriptions, as "
        "`uma fit --help` (and `--model.help CLASS`, `--data.help CLASS`) reads them. Keys are set in a "
        "recipe or on the command line (`--model.init_args.optimizer.lr 1e-3`, or shorter, "
        "`--model.optimizer.lr 1e-3`). How recipes compose is in "
        "[Recipes and configuration](../guides/configuration.md). `trainer.*` keys other than these are "
        "Lightning's own Trainer arguments (`uma fit --help`, in [the uma command](cli.md)).",
        "",
    ]
    for prefix, path, what, keys in all_keys():
        out += [f"## `{prefix}`: {path.rpartition('.')[2]}", "", f"{what.capitalize()}; `{path}`.", ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for key in keys:
            out.append(
                f"| `{key.name}` | {escape(key.type)} | {escape(key.default)} | {escape(key.description) or '(none)'} |"
            )
        out.append("")
    return "\n".join(out)


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def help_text(argv: list[str]) -> str:
    """What ``uma ARGV`` prints (``--help``, say), at a fixed width so a page does not depend on the terminal."""
    from uma_lightning.command import main

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return buffer.getvalue().rstrip()


def subcommands_of(help_output: str) -> list[str]:
    """The ``{a,b,c}`` choices of a tool's usage line: its subcommands."""
    found = re.search(r"\{([a-z_,-]+)\}", help_output)
    return found.group(1).split(",") if found else []


def cli_page() -> str:
    from uma_lightning.subcommands import TOOLS

    out = [
        "# The uma command",
        "",
        "Generated from the code: what each subcommand's `--help` prints. The training subcommands are "
        "LightningCLI's; the tools beside training parse their own arguments.",
        "",
    ]
    commands = [[name] for name in TRAINING_COMMANDS]
    for tool in TOOLS:
        commands.append([tool])
        commands += [[tool, sub] for sub in subcommands_of(help_text([tool, "--help"]))]
    for argv in commands:
        out += [f"## `uma {' '.join(argv)}`", "", "```", help_text([*argv, "--help"]), "```", ""]
    return "\n".join(out)


def shipped_callbacks() -> list[type]:
    """Every callback class ``uma_lightning.callbacks`` exports, by name."""
    from lightning.pytorch.callbacks import Callback

    import uma_lightning.callbacks as callbacks

    found = (getattr(callbacks, name) for name in sorted(callbacks.__all__))
    return [cls for cls in found if inspect.isclass(cls) and issubclass(cls, Callback)]


def callback_keys() -> list[Key]:
    return [key for cls in shipped_callbacks() for key in section_keys(cls)]


def callbacks_page() -> str:
    out = [
        "# Callbacks",
        "",
        "Generated from the code: every callback of `uma_lightning.callbacks`, its docstring and its "
        "arguments (set under `init_args` in a recipe's `trainer.callbacks`). Which recipes turn which "
        "on is in [Diagnostics](../guides/diagnostics.md).",
        "",
    ]
    for cls in shipped_callbacks():
        name = cls.__name__
        out += [f"## {name}", "", f"`uma_lightning.callbacks.{name}`", "", inspect.getdoc(cls) or "", ""]
        keys = section_keys(cls)
        if keys:
            out += ["| argument | type | default | description |", "|---|---|---|---|"]
            out += [
                f"| `{k.name}` | {escape(k.type)} | {escape(k.default)} | {escape(k.description) or '(none)'} |"
                for k in keys
            ]
            out.append("")
    return "\n".join(out)


REPO = Path(__file__).resolve().parents[1]
# Pictures drawn by the tools, shown by the pages: the image's place in the site -> the uma command
# that draws it (given --plot FILE). Small generated data: the recipe's data only gives the shapes.
PICTURES = {
    "tutorials/layout.png": ["plan", "--config", str(REPO / "recipes" / "pretrain.yaml"), "--model.network.size", "7b",
                             "--nodes", "4", "--gpus-per-node", "8", "--gpu", "h200"],
    # The tutorial's comparison on the test suite's one-layer model of width 32 (about 3 s).
    "tutorials/precision.png": ["parity", "--config", str(REPO / "recipes" / "pretrain.yaml"), "--precision", "bf16-mixed",
                                "--steps", "2", "--data.batch_size", "4", "--model.network.size",
                                '{"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}'],
}  # fmt: skip


def picture(argv: list[str]) -> bytes:
    """The PNG that ``uma ARGV --plot FILE`` draws, with its dataset generated in a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        image = Path(folder) / "picture.png"
        data = ["--data.generation.n_episodes", "6", "--data.generation.cache_dir", folder]
        output = help_text([*argv, *data, "--plot", str(image)])
        if not image.is_file():
            raise RuntimeError(f"uma {' '.join(argv)} drew no picture:\n{output}")
        return image.read_bytes()


# The run whose step time the first-run tutorial shows: the recipe on the test suite's one-layer model
# of width 32 and six generated episodes, 12 steps without validation (about 2 s of training).
STEP_TIME_RUN = ["fit", "--config", str(REPO / "recipes" / "pretrain.yaml"), "--model.network.size",
                 '{"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}', "--data.batch_size", "4",
                 "--data.generation.n_episodes", "6", "--data.loader.num_workers", "0", "--trainer.max_steps", "12",
                 "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
                 "--trainer.logger.init_args.log_policy", "false"]  # fmt: skip


def step_time_picture() -> bytes:
    """The PNG that ``uma report steptime runs/pretrain --plot FILE`` draws of a short run trained now,
    in a temporary folder that holds its dataset, its run directory and its MLflow store."""
    saved_uri = os.environ.get("MLFLOW_TRACKING_URI")
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        # Its own store, whatever the environment names; MLflow exports the URI it is given.
        store = ["--trainer.logger.init_args.tracking_uri", f"sqlite:///{folder}/mlflow.db"]
        try:
            trained = help_text([*STEP_TIME_RUN, *store, "--data.generation.cache_dir", folder])
            output = help_text(["report", "steptime", "runs/pretrain", "--plot", "steps.png"])
        finally:
            if saved_uri is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved_uri
        if not Path("steps.png").is_file():
            raise RuntimeError(f"uma report steptime drew no picture:\n{trained}\n{output}")
        return Path("steps.png").read_bytes()


def schedule_picture(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> bytes:
    """The PNG of a pipeline schedule's timeline, drawn by the planner's schedule module (no processes)."""
    from uma_lightning.tools.planner.schedule import plot_schedule

    with tempfile.TemporaryDirectory() as folder:
        image = Path(folder) / "schedule.png"
        plot_schedule(str(image), schedule, ranks, microbatches, virtual_stages)
        return image.read_bytes()


# Schedules drawn for the pipeline guide: the image's place in the site -> (schedule, ranks, microbatches, stages per rank).
SCHEDULE_PICTURES = {
    "guides/schedule-1f1b.png": ("1F1B", 4, 8, 1),
    "guides/schedule-interleaved.png": ("Interleaved1F1B", 4, 8, 2),
}


def reference_pages() -> dict[str, str]:
    return {
        "reference/cli.md": cli_page(),
        "reference/config.md": config_page(),
        "reference/callbacks.md": callbacks_page(),
    }


def on_files(files, config):
    """mkdocs hook: add the generated pages to the site, as if they were files in docs/."""
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    for path, argv in PICTURES.items():
        files.append(File.generated(config, path, content=picture(argv)))
    for path, drawn in SCHEDULE_PICTURES.items():
        files.append(File.generated(config, path, content=schedule_picture(*drawn)))
    files.append(File.generated(config, "tutorials/steps.png", content=step_time_picture()))
    return files
