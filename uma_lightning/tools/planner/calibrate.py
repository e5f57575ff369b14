"""The achievable fraction of peak (``--mfu``) measured by a finished run instead of assumed.

A run logs ``throughput/mfu_percent`` to MLflow every step (``callbacks/throughput.py``); its
checkpoints' manifests name its MLflow run, and its saved config names the tracking store.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import yaml

MFU_METRIC = "throughput/mfu_percent"


def tracking_uri(run_config: dict) -> str:
    """Where the run logged: its logger's tracking_uri, $MLFLOW_TRACKING_URI, or its embedded store, as ``MLflowLogger`` chooses."""
    from uma_lightning.tracking.mlflow_logger import local_store_uri

    logger = (run_config.get("trainer") or {}).get("logger") or {}
    init_args = logger.get("init_args") or {} if isinstance(logger, dict) else {}
    return (
        init_args.get("tracking_uri")
        or os.environ.get("MLFLOW_TRACKING_URI")
        or local_store_uri(init_args.get("store_dir") or "mlruns")
    )


def measured_mfu(run_dir: str) -> float:
    """The median MFU (a fraction) a run logged, read from the MLflow run its newest checkpoint names."""
    return statistics.median(value for _, value in metric_histories(run_dir, [MFU_METRIC])[MFU_METRIC]) / 100


def metric_histories(run_dir: str, names: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) history, read from the MLflow run the run's newest checkpoint names;
    a ValueError if none of ``names`` was logged."""
    from mlflow.tracking import MlflowClient

    from uma_lightning.checkpoint.directory import committed
    from uma_lightning.checkpoint.manifest import read_manifest

    run = Path(run_dir)
    checkpoints = committed(run / "checkpoints")
    if not (run / "config.yaml").is_file() or not checkpoints:
        raise ValueError(
            f"{run_dir} is not a run directory with a config.yaml and a checkpoint (they name its MLflow run)"
        )
    run_id = read_manifest(checkpoints[-1][1]).get("mlflow_run_id")
    if not run_id:
        raise ValueError(f"{run_dir}: its checkpoint names no MLflow run (was tracking off?)")
    uri = tracking_uri(yaml.safe_load((run / "config.yaml").read_text()) or {})
    client = MlflowClient(uri)
    histories = {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in names}
    if not any(histories.values()):
        raise ValueError(f"{run_dir}: MLflow run {run_id} in {uri} logged no {' or '.join(names)}")
    return histories
