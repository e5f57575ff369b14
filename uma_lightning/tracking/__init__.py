"""Experiment tracking: MLflow wiring, run provenance, and step metrics from callbacks."""

from uma_lightning.tracking.mlflow_logger import MLflowLogger, find_mlflow_logger, log_artifact
from uma_lightning.tracking.run_config import RecordRunConfig
from uma_lightning.tracking.step_metrics import log_step_metrics

__all__ = ["MLflowLogger", "RecordRunConfig", "find_mlflow_logger", "log_artifact", "log_step_metrics"]
