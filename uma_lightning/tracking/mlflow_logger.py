"""MLflow logger with this project's defaults: an embedded store when no server is given, async metrics.

MLflow itself is imported where it is used (0.8 s): a process that logs nothing, such as a test of the
callbacks or a benchmark on a machine without MLflow, does not pay for it."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sys
from argparse import Namespace
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Literal, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

from uma_lightning.cache_dir import default_cache_dir
from uma_lightning.lightning_compat import (
    continue_mlflow_run,
    mlflow_client,
    mlflow_run_opened,
    mlflow_tracking_uri,
    name_mlflow_run,
    replace_mlflow_client,
)

log = logging.getLogger(__name__)

ASYNC_BUFFERING_SECONDS = 5
BUFFERING_VARIABLE = "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"
# Batches kept for sending again (resending_client.py) are confirmed at each flush (each checkpoint); a run
# that saves none is flushed after this many, so that they do not pile up.
MAX_UNCONFIRMED_BATCHES = 1000
MAX_PARAM_LENGTH = 250  # Lightning's MLFlowLogger cuts longer param values to this length


def local_store_uri(store_dir: str | Path) -> str:
    return f"sqlite:///{Path(store_dir).resolve() / 'mlflow.db'}"


class MLflowLogger(LightningMLFlowLogger):
    def __init__(
        self,
        experiment_name: str = "uma",
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        store_dir: str = "mlruns",
        tags: Optional[dict[str, str]] = None,
        synchronous: bool = False,
        run_id: Optional[str] = None,
        log_policy: bool = True,
        register_model: Optional[str] = None,
        policy_weights: Literal["artifact", "reference"] = "artifact",
    ):
        """
        Args:
            experiment_name: MLflow experiment the run belongs to.
            run_name: Display name of the run; MLflow picks one when empty.
            tracking_uri: Server or store to log to. Defaults to $MLFLOW_TRACKING_URI, else an embedded
                sqlite store in ``store_dir`` (no server needed).
            store_dir: Directory of the embedded store and its artifacts; ignored when a server is used.
            tags: Extra run tags.
            synchronous: Block on every logging call. Off by default so logging never stalls a step.
            run_id: Continue this existing run instead of starting a new one.
            log_policy: When ``uma fit`` ends, log the policy of its newest sharded checkpoint as the
                run's MLflow Model ``model`` (``runs:/<run id>/model``; see ``policy_model.py``).
            register_model: Also register that model in the Model Registry under this name (whatever
                ``log_policy`` says), as a new version tagged with the run's ``final/`` metrics
                (``models:/NAME/VERSION``).
            policy_weights: ``artifact``: the model holds a copy of the weights; ``reference``: it
                reads the checkpoint where it is (no copy, but it breaks if the checkpoint moves).
        """
        if policy_weights not in ("artifact", "reference"):
            raise ValueError(f"policy_weights must be 'artifact' or 'reference', got {policy_weights!r}")
        # MLflow's async writer otherwise commits every logging call on its own, several per step, and
        # its thread takes CPU and the GIL from training; merging what arrives within a few seconds
        # into one write removes most of that. A value set in the environment is kept (0: no merging).
        buffering = os.environ.setdefault(BUFFERING_VARIABLE, str(ASYNC_BUFFERING_SECONDS))
        if not buffering.isdigit():
            # MLflow would only find out in its writer thread, which then dies and drops every metric.
            raise ValueError(
                f"${BUFFERING_VARIABLE} must be a whole number of seconds (0: no merging), got {buffering!r}"
            )
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(store_dir)
        # With an embedded store the artifacts live beside it; a server chooses its own location.
        embedded = uri.startswith("sqlite:")
        artifacts = (Path(store_dir).resolve() / "artifacts").as_uri() if embedded else None
        with _store_lock(store_dir if embedded else None):
            if embedded:
                _seed_new_store(Path(store_dir).resolve() / "mlflow.db")
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name,
                tracking_uri=uri,
                tags=tags,
                artifact_location=artifacts,
                run_id=run_id,
                synchronous=synchronous,
            )
        from uma_lightning.tracking.resending_client import ResendingClient

        replace_mlflow_client(self, ResendingClient(uri))
        self.log_policy = log_policy or bool(register_model)
        self.register_model = register_model
        self.policy_weights = policy_weights
        self._continued = False
        self._status_before: Optional[str] = None  # of the continued run
        self._metrics_logged = False
        self._params_from_config = False
        self._flush_after_next_metrics = False

    @rank_zero_only
    def name_new_run(self, name: str, overrides: str) -> None:
        """Give the run this logger opens the display ``name``, unless one was configured
        (``run_name``) or an existing run is continued (it keeps its name). ``overrides`` goes into
        the ``overrides`` tag in full, for search. Call before anything is logged."""
        if name_mlflow_run(self, name):
            self.tags = {**(self.tags or {}), "overrides": overrides}

    @rank_zero_only
    def continue_run(self, run_id: str) -> None:
        """Log into the existing run ``run_id`` instead of opening a new one: a job resumed from a
        checkpoint continues its run, and the run's step axis. Call before anything is logged."""
        from mlflow.exceptions import MlflowException

        if mlflow_run_opened(self):
            if self.run_id != run_id:
                log.warning("MLflow run %s is already open; cannot continue run %s in it", self.run_id, run_id)
            return
        client = mlflow_client(self)
        try:
            run = client.get_run(run_id)
        except MlflowException as err:
            log.warning("cannot continue MLflow run %s (%s); a new run is opened", run_id, err)
            return
        continue_mlflow_run(self, run_id)
        self._continued = True
        self._status_before = run.info.status
        client.update_run(run_id, status="RUNNING")
        log.info("continuing MLflow run %s", run_id)

    @rank_zero_only
    def finish_run(self, run_id: str) -> None:
        """Mark the existing run ``run_id`` FINISHED, unless it is; nothing else about it changes."""
        from mlflow.exceptions import MlflowException

        client = mlflow_client(self)
        try:
            status = client.get_run(run_id).info.status
        except MlflowException as err:
            log.warning("cannot mark MLflow run %s FINISHED (%s)", run_id, err)
            return
        if status != "FINISHED":
            client.set_terminated(run_id, "FINISHED")
            log.info("MLflow run %s marked FINISHED (it was %s): its last checkpoint reached max_steps", run_id, status)

    @rank_zero_only
    def log_tags(self, tags: dict[str, str]) -> None:
        """Set the run's tags. A continued run keeps the tags it has (its ``command``, ``host``, ...): the
        values of this resumption that differ go under ``resumed.<tag>``."""
        from mlflow.entities import RunTag

        if self._continued:
            existing = self.experiment.get_run(self.run_id).data.tags
            tags = {
                (f"resumed.{key}" if key in existing and existing[key] != value else key): value
                for key, value in tags.items()
            }
        self.experiment.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in tags.items()])

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        """Lightning's entry point, called with the data module's saved hyperparameters, without a
        section and with noise such as ``_instantiator``. Under ``uma`` the resolved config is logged
        instead (``log_params``), which holds the same values in their sections, so this call is
        dropped there rather than logging each of them a second time."""
        if not self._params_from_config:
            self._log_flat(flatten_params(params))

    @rank_zero_only
    def log_params(self, params: dict, from_config: bool = False) -> None:
        """Log ``params`` flattened into sections (``trainer/max_steps``); ``from_config``: they are
        the run's resolved config, so Lightning's own hyperparameter logging is redundant."""
        self._params_from_config |= from_config
        self._log_flat(flatten_params(params))

    def _log_flat(self, flat: dict[str, str]) -> None:
        if not self._continued:
            return super().log_hyperparams(flat)
        # MLflow refuses to change a param of an existing run: a resumed job whose config changed
        # (say, more steps) keeps the original values and says which ones changed.
        existing = self.experiment.get_run(self.run_id).data.params
        changed = sorted(
            key for key, value in flat.items() if key in existing and existing[key] != value[:MAX_PARAM_LENGTH]
        )
        if changed:
            log.warning("the continued MLflow run keeps its original values of changed params: %s", ", ".join(changed))
            self.experiment.set_tag(self.run_id, "params_changed_on_resume", ", ".join(changed)[:5000])
        super().log_hyperparams({key: value for key, value in flat.items() if key not in changed})

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if status == "success":
            return self._finalize(status)
        # Lightning finalizes loggers with "failed" on any exception, before it stops the loader workers:
        # a run stopped by a signal (preemption, Ctrl+C) is KILLED, not FAILED, and a tracking store
        # that fails now must neither hide why the run stopped nor keep the trainer from tearing down.
        if isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt)):
            status = "KILLED"
        if self._continued and not self._metrics_logged and self._status_before in ("FINISHED", "KILLED", "FAILED"):
            # Stopped before it trained a step (a checkpoint that would not load, say): the run it
            # continued ends as it had ended, not failed by this command.
            log.warning(
                "MLflow run %s keeps its status %s: this command stopped before training",
                self.run_id,
                self._status_before,
            )
            status = self._status_before
        try:
            self._finalize(status)
        except Exception as err:
            log.error("could not mark MLflow run %s as %s: %s", self.run_id, status, err)

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        """A killed run resumes from its newest checkpoint, so the metrics of the steps before it must
        not wait in MLflow's async queue (up to $MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS), where a SIGKILL loses them
        for good. Drained now, and again after the next metrics: Lightning logs a step's metrics after
        the hook in which that step's checkpoint was saved."""
        self._flush()
        self._flush_after_next_metrics = True
        super().after_save_checkpoint(checkpoint_callback)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self._metrics_logged = True
        super().log_metrics(metrics, step)
        if self._flush_after_next_metrics or mlflow_client(self).unconfirmed >= MAX_UNCONFIRMED_BATCHES:
            self._flush_after_next_metrics = False
            self._flush()

    def _finalize(self, status: str) -> None:
        self._flush(last=True)  # before the run is marked finished
        super().finalize(status)

    def flush(self) -> None:
        """Write out every metric still waiting in MLflow's async queue (and again what it failed to store)."""
        self._flush()

    def _flush(self, last: bool = False) -> None:
        if mlflow_run_opened(self):
            flush_async_logging(mlflow_tracking_uri(self))
            mlflow_client(self).confirm(last)


def flatten_params(params, prefix: str = "") -> dict[str, str]:
    """Nested config as MLflow params: one ``section/key`` per leaf, as strings. A list of
    ``class_path`` entries (callbacks) is keyed by class name, so adding one callback does not
    renumber the others; other lists of mappings (a dataset mixture) by position; lists of plain
    values stay one param. Keys starting with ``_`` (Lightning's ``_instantiator``) are left out."""
    if is_dataclass(params) and not isinstance(params, type):
        params = asdict(params)
    elif isinstance(params, Namespace):
        params = vars(params)
    if isinstance(params, Mapping):
        items = [(str(key), value) for key, value in params.items() if not str(key).startswith("_")]
    elif isinstance(params, (list, tuple)) and params and all(isinstance(item, Mapping) for item in params):
        items = list(zip(_list_keys(params), params))
    else:
        return {prefix: str(params)}
    flat = {}
    for key, value in items:
        flat.update(flatten_params(value, f"{prefix}/{key}" if prefix else key))
    return flat


def _list_keys(items: list) -> list[str]:
    names = [str(item["class_path"]).rsplit(".", 1)[-1] if "class_path" in item else None for item in items]
    if None in names or len(set(names)) < len(names):
        return [str(index) for index in range(len(items))]
    return names


def flush_async_logging(tracking_uri: str) -> None:
    """Drain MLflow's async logging queue of the store at ``tracking_uri``. Not through
    ``mlflow.set_tracking_uri``, which also sets $MLFLOW_TRACKING_URI, so every process started
    afterwards (the next run, a test's ``uma fit``) would log into this store."""
    from mlflow.tracking._tracking_service.utils import _get_store

    _get_store(tracking_uri).flush_async_logging()


@contextmanager
def _store_lock(store_dir: Optional[str]):
    """Every rank builds a logger, and its MLflow client creates the sqlite tables of a new store;
    ranks that do so at once break the schema migration, so they take turns."""
    if store_dir is None:
        yield
        return
    Path(store_dir).mkdir(parents=True, exist_ok=True)
    with _locked(Path(store_dir) / ".create.lock"):
        yield


@contextmanager
def _locked(path: Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def empty_store_template() -> Path:
    """An embedded store with MLflow's tables and nothing in them, made once per MLflow version in the
    cache. MLflow makes a new store's tables by running every schema migration it has, 1.5 s of a
    short run's 7 s on a laptop core; a copy of this file takes a millisecond, and MLflow opens it as
    the store it would have made (same schema revision; the default experiment is created on first
    open, with this store's artifact location)."""
    import mlflow

    template = default_cache_dir() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with _locked(template.with_name(template.name + ".lock")):
        if not template.exists():
            from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine

            partial = template.with_name(f"{template.name}.{os.getpid()}.partial")
            engine = create_sqlalchemy_engine(f"sqlite:///{partial}")
            try:
                _initialize_tables(engine)  # what MLflow runs for a new database, without the default experiment
            finally:
                engine.dispose()
            os.replace(partial, template)
    return template


def _seed_new_store(db: Path) -> None:
    """Start a store that does not exist yet as a copy of the empty template (see ``empty_store_template``).
    Where the cache cannot be written, MLflow creates the tables itself, as it always does."""
    from mlflow.exceptions import MlflowException

    if db.exists():
        return
    try:
        template = empty_store_template()
    except (OSError, MlflowException) as error:
        log.debug("no empty MLflow store template (%s); MLflow creates the tables", error)
        return
    partial = db.with_name(db.name + ".partial")
    shutil.copyfile(template, partial)
    os.replace(partial, db)


def find_mlflow_logger(trainer: Trainer) -> Optional[LightningMLFlowLogger]:
    """The trainer's MLflow logger on global rank zero, else None (other ranks never talk to MLflow)."""
    if not trainer.is_global_zero:
        return None
    return next((lg for lg in trainer.loggers if isinstance(lg, LightningMLFlowLogger)), None)


def log_artifact(trainer: Trainer, path: str | Path, artifact_dir: Optional[str] = None) -> bool:
    """Uploads a file or a folder's files into the run's artifacts; False when there is no MLflow run."""
    logger = find_mlflow_logger(trainer)
    if logger is None:
        return False
    path = Path(path)
    if path.is_dir():
        logger.experiment.log_artifacts(logger.run_id, str(path), artifact_dir)
    else:
        logger.experiment.log_artifact(logger.run_id, str(path), artifact_dir)
    return True
