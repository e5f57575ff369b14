"""Every use of Lightning's private attributes, in one place.

Each function below does something Lightning has no public hook or API for, and says why it is
needed. ``tests/test_lightning_compat.py`` runs each one against the installed Lightning and fails
naming the attribute and the version when an upgrade renames or removes one; ``pyproject.toml`` pins
the Lightning versions that test has passed on. Nothing outside this module reaches into Lightning's
privates (the same test checks the source).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import lightning
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import MLFlowLogger

VERSION = lightning.__version__

# The private names used here, by where they live; the compat test checks each on a real object.
PRIVATE_NAMES = {
    "_TrainingEpochLoop": ("_batches_that_stepped", "_on_before_fetch"),
    "_FitLoop": ("_data_fetcher", "_combined_loader"),
    "Trainer": ("_accelerator_connector",),
    "FSDPStrategy": ("_registered_strategies",),
    "MLFlowLogger": ("_tracking_uri", "_experiment_name", "_mlflow_client", "_initialized", "_run_id", "_run_name"),
    "lightning.fabric.utilities.optimizer": ("_optimizers_to_device",),
}


# ---- the training loop ---------------------------------------------------------------------------


def log_step(trainer: Trainer) -> int:
    """The step Lightning logs the current batch's ``self.log`` metrics at: it advances after each
    optimizer step, so it is 0 for the first one. Not ``trainer.global_step``, which counts the steps
    of every optimizer and is not the axis Lightning logs on."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_log_step(trainer: Trainer, step: int) -> None:
    """Put Lightning's logging step back (after a rollback), so later metrics continue the restored axis."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def fetch_hook(trainer: Trainer) -> Optional[Callable[[], None]]:
    """What the training loop calls just before it fetches each batch (it is there for the profiler);
    None when this Lightning has no such hook. Callbacks have no hook at that moment."""
    return getattr(trainer.fit_loop.epoch_loop, "_on_before_fetch", None)


def set_fetch_hook(trainer: Trainer, hook: Callable[[], None]) -> None:
    trainer.fit_loop.epoch_loop._on_before_fetch = hook


def forget_train_loader(trainer: Trainer) -> None:
    """Make the fit loop build and start its train loader afresh at its next ``setup_data``; Lightning
    only does so itself when asked to reload loaders every epoch."""
    fit_loop = trainer.fit_loop
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()
        fit_loop._data_fetcher = None
    fit_loop._combined_loader = None


def cluster_environment(trainer: Trainer) -> ClusterEnvironment:
    """The cluster environment the trainer detected or was given (say, ``SLURMEnvironment`` with
    ``auto_requeue``). Parallel strategies hold it publicly; a single-device strategy does not, though
    the job may be a Slurm job all the same."""
    return trainer._accelerator_connector.cluster_environment


# ---- strategies -----------------------------------------------------------------------------------


def release_strategy_name(strategy_class: type, name: str) -> None:
    """Stop Lightning from treating ``name`` as ``strategy_class``'s: its accelerator checks refuse
    some names by the strategy they meant (``"fsdp"`` off GPU) even when the registry says otherwise."""
    if name in strategy_class._registered_strategies:
        strategy_class._registered_strategies.remove(name)


def optimizers_to_device(optimizers, device) -> None:
    """Move optimizer state to ``device`` as Lightning's own strategies do in ``setup`` (which keeps
    each ``step`` counter where the optimizer expects it); a strategy that overrides ``setup`` needs it."""
    _optimizers_to_device(optimizers, device)


# ---- the MLflow logger ----------------------------------------------------------------------------
# Lightning's MLFlowLogger opens its run when ``experiment`` is first read and exposes neither its
# store nor a way to continue an existing run after construction; a resumed job needs both.


def mlflow_tracking_uri(logger: MLFlowLogger) -> str:
    return logger._tracking_uri


def mlflow_experiment_name(logger: MLFlowLogger) -> str:
    return logger._experiment_name


def mlflow_client(logger: MLFlowLogger):
    """The logger's MLflow client, without opening a run (``logger.experiment`` would)."""
    return logger._mlflow_client


def replace_mlflow_client(logger: MLFlowLogger, client) -> None:
    """Have the logger talk to MLflow through ``client`` (a subclass of ``MlflowClient``)."""
    logger._mlflow_client = client


def mlflow_run_opened(logger: MLFlowLogger) -> bool:
    return logger._initialized


def continue_mlflow_run(logger: MLFlowLogger, run_id: str) -> None:
    """Make a logger whose run is not open yet open ``run_id`` instead of a new run, as the
    constructor's ``run_id`` argument would have."""
    logger._run_id = run_id


def name_mlflow_run(logger: MLFlowLogger, name: str) -> bool:
    """Give the run the logger has yet to open the display ``name``. False, and nothing changed, when
    a name was configured, a run to continue was given, or the run is open already."""
    if logger._run_name is not None or logger._run_id is not None or logger._initialized:
        return False
    logger._run_name = name
    return True
