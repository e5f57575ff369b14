"""Lightning's private attributes: every one the project uses still behaves as ``lightning_compat`` expects,
and no module but ``lightning_compat`` reaches for one."""

import ast
from contextlib import contextmanager
from pathlib import Path

import lightning
import pytest
import torch
from checkpoint_modules import LinearRegression
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.strategies import FSDPStrategy

try:
    from uma_lightning import lightning_compat as compat
except ImportError as err:  # a private function compat imports is gone
    raise ImportError(
        f"Lightning {lightning.__version__} changed {err.name}: {err}; update uma_lightning/lightning_compat.py"
    ) from err

REPO = Path(__file__).resolve().parents[1]


def changed(name: str, detail: str) -> str:
    return f"Lightning {lightning.__version__} changed {name}: {detail}; update uma_lightning/lightning_compat.py and the Lightning range in pyproject.toml"


class Probe(Callback):
    """Exercises each loop accessor mid-fit and keeps what it saw."""

    def __init__(self):
        self.log_steps, self.fetches, self.problems = [], 0, []

    def on_train_epoch_start(self, trainer, pl_module):
        original = compat.fetch_hook(trainer)
        if not callable(original):
            self.problems.append(
                changed("_TrainingEpochLoop._on_before_fetch", f"it is {original!r}, not the loop's fetch hook")
            )
            return

        def counting():
            self.fetches += 1
            original()

        compat.set_fetch_hook(trainer, counting)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            compat.set_log_step(trainer, 7)  # as the anomaly detector does after a rollback
        self.log_steps.append(compat.log_step(trainer))


def check(condition: bool, name: str, detail: str) -> None:
    if not condition:
        pytest.fail(changed(name, detail), pytrace=False)


@contextmanager
def reaching(name: str):
    """Turn the AttributeError of a renamed or removed private into the loud message."""
    try:
        yield
    except AttributeError as err:
        pytest.fail(changed(name, f"{type(err).__name__}: {err}"), pytrace=False)


def test_every_private_lightning_access_still_works(tmp_path):
    probe = Probe()
    trainer = Trainer(
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[probe],
        default_root_dir=tmp_path,
    )
    for name in ("_batches_that_stepped", "_on_before_fetch"):
        check(hasattr(trainer.fit_loop.epoch_loop, name), f"_TrainingEpochLoop.{name}", "no such attribute")
    with reaching("the training loop's _batches_that_stepped or _on_before_fetch"):
        trainer.fit(LinearRegression())
    assert not probe.problems, probe.problems
    # The logging step advances once per optimizer step, and a value set sticks (the rollback's case).
    check(
        probe.log_steps == [0, 1, 7, 8],
        "_TrainingEpochLoop._batches_that_stepped",
        f"steps seen {probe.log_steps}, expected [0, 1, 7, 8]",
    )
    check(probe.fetches >= 4, "_TrainingEpochLoop._on_before_fetch", f"called {probe.fetches} times for 4 batches")

    fit_loop = trainer.fit_loop
    for name in ("_data_fetcher", "_combined_loader"):
        check(hasattr(fit_loop, name), f"_FitLoop.{name}", "no such attribute")
    check(fit_loop._combined_loader is not None, "_FitLoop._combined_loader", "None after a fit")
    with reaching("_FitLoop._data_fetcher or _combined_loader"):
        compat.forget_train_loader(trainer)
    fit_loop.setup_data()
    check(fit_loop._combined_loader is not None, "_FitLoop.setup_data", "does not rebuild a forgotten train loader")

    with reaching("Trainer._accelerator_connector.cluster_environment"):
        environment = compat.cluster_environment(trainer)
    check(
        type(environment).__name__ == "LightningEnvironment",
        "Trainer._accelerator_connector.cluster_environment",
        f"is {environment!r}, expected the detected LightningEnvironment",
    )

    with reaching("FSDPStrategy._registered_strategies"):
        registered = FSDPStrategy._registered_strategies
    check(
        isinstance(registered, list),
        "FSDPStrategy._registered_strategies",
        f"is {type(registered).__name__}, not a list",
    )


def test_optimizers_move_with_lightnings_own_function():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([parameter])
    parameter.grad = torch.ones(2)
    optimizer.step()
    compat.optimizers_to_device([optimizer], torch.device("meta"))
    state = optimizer.state[parameter]
    check(
        state["exp_avg"].device.type == "meta",
        "lightning.fabric.utilities.optimizer._optimizers_to_device",
        "did not move optimizer state",
    )


def test_the_mlflow_logger_privates_are_there():
    uri = "http://127.0.0.1:9"  # never contacted: the logger opens nothing until it is used
    logger = MLFlowLogger(experiment_name="compat", tracking_uri=uri)
    with reaching("MLFlowLogger._tracking_uri, _experiment_name, _initialized or _mlflow_client"):
        seen = (
            compat.mlflow_tracking_uri(logger),
            compat.mlflow_experiment_name(logger),
            compat.mlflow_run_opened(logger),
            compat.mlflow_client(logger),
        )
    check(seen[0] == uri, "MLFlowLogger._tracking_uri", f"is {seen[0]!r}, not the tracking URI")
    check(seen[1] == "compat", "MLFlowLogger._experiment_name", f"is {seen[1]!r}, not the experiment name")
    check(seen[2] is False, "MLFlowLogger._initialized", f"is {seen[2]!r} before the run opens, not False")
    check(
        type(seen[3]).__name__ == "MlflowClient", "MLFlowLogger._mlflow_client", f"is {seen[3]!r}, not an MlflowClient"
    )
    compat.continue_mlflow_run(logger, "abc")
    check(logger._run_id == "abc", "MLFlowLogger._run_id", "is not where the run to open is kept")
    check(
        compat.name_mlflow_run(MLFlowLogger(tracking_uri=uri), "mine") is True,
        "MLFlowLogger._run_name",
        "refused a logger with no name",
    )
    named = MLFlowLogger(tracking_uri=uri, run_name="given")
    check(
        compat.name_mlflow_run(named, "mine") is False and named._run_name == "given",
        "MLFlowLogger._run_name",
        "is not where the configured name is kept",
    )


def private_lightning_uses(source: Path, private_names: set[str]) -> list[str]:
    """``file:line: what`` for each private Lightning import, and each use of a private name compat
    lists (on any object, ``self`` too: a subclass of a Lightning class is no exception)."""
    found = []
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            found += [
                f"{source}:{node.lineno}: imports {alias.name}" for alias in node.names if alias.name.startswith("_")
            ]
        elif isinstance(node, ast.Attribute) and node.attr in private_names:
            found.append(f"{source}:{node.lineno}: .{node.attr}")
    return found


def test_no_other_module_reaches_into_lightning():
    private = {name for names in compat.PRIVATE_NAMES.values() for name in names}
    sources = [s for folder in ("uma_lightning", "callbacks", "kernels") for s in sorted((REPO / folder).rglob("*.py"))]
    found = [
        use
        for source in sources
        if source.name != "lightning_compat.py"
        for use in private_lightning_uses(source, private)
    ]
    assert not found, "Lightning privates outside uma_lightning/lightning_compat.py:\n" + "\n".join(found)


def test_the_source_check_flags_a_private_access(tmp_path):
    source = tmp_path / "leaky.py"
    source.write_text(
        "from lightning.fabric.utilities.logger import _flatten_dict\n"
        "def f(trainer, self):\n    return trainer.fit_loop.epoch_loop._batches_that_stepped, self._run_id\n"
    )
    uses = private_lightning_uses(source, {"_batches_that_stepped", "_run_id"})
    assert uses == [
        f"{source}:1: imports _flatten_dict",
        f"{source}:3: ._batches_that_stepped",
        f"{source}:3: ._run_id",
    ]
    source.write_text(
        "from lightning.pytorch import Trainer\ndef f(trainer):\n    return trainer.global_step, trainer._own\n"
    )
    assert private_lightning_uses(source, {"_batches_that_stepped", "_run_id"}) == []
