"""Experiment tracking: MLflow wiring and run provenance."""

from uma_lightning.tracking.mlflow_logger import MLflowLogger
from uma_lightning.tracking.run_config import RecordRunConfig

__all__ = ["MLflowLogger", "RecordRunConfig"]
