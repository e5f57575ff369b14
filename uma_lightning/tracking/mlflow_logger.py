"""MLflow logger with this project's defaults: an embedded store when no server is given, async metrics."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import mlflow
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only


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
        """
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri(store_dir)
        # With an embedded store the artifacts live beside it; a server chooses its own location.
        embedded = uri.startswith("sqlite:")
        artifacts = (Path(store_dir).resolve() / "artifacts").as_uri() if embedded else None
        with _store_lock(store_dir if embedded else None):
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name,
                tracking_uri=uri,
                tags=tags,
                artifact_location=artifacts,
                run_id=run_id,
                synchronous=synchronous,
            )

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self._initialized:
            # Metrics go through MLflow's async queue; drain it before the run is marked finished.
            mlflow.set_tracking_uri(self._tracking_uri)
            mlflow.flush_async_logging()
        super().finalize(status)


@contextmanager
def _store_lock(store_dir: Optional[str]):
    """Every rank builds a logger, and its MLflow client creates the sqlite tables of a new store;
    ranks that do so at once break the schema migration, so they take turns."""
    if store_dir is None:
        yield
        return
    Path(store_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(store_dir) / ".create.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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
