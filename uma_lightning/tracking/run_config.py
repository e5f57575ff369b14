"""Records a run's resolved config, tags and output locations, in the run directory and in MLflow."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from uma_lightning.tracking.provenance import run_tags

log = logging.getLogger(__name__)


class RecordRunConfig(SaveConfigCallback):
    """Writes ``<run dir>/config.yaml`` and, with an MLflow logger, logs that config as an artifact and
    as flattened params, plus provenance tags. Runs on global rank zero only."""

    def __init__(self, *args, recipe: Optional[str] = None, **kwargs):
        super().__init__(*args, save_to_log_dir=False, **kwargs)
        self.recipe = recipe

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / self.config_filename
        self.parser.save(self.config, config_path, skip_none=False, overwrite=True, multifile=False)
        logger = _mlflow_logger(trainer)
        if logger is None:
            return
        logger.log_hyperparams(yaml.safe_load(config_path.read_text()))
        tags = run_tags(trainer.world_size)
        tags["run_dir"] = str(run_dir.resolve())
        tags["stage"] = stage
        if self.recipe:
            tags["recipe"] = self.recipe
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.dirpath:
            tags["checkpoint_dir"] = str(trainer.checkpoint_callback.dirpath)
        for key, value in tags.items():
            logger.experiment.set_tag(logger.run_id, key, value)
        logger.experiment.log_artifact(logger.run_id, str(config_path))
        log.info("MLflow run %s (%s), run dir %s", logger.run_id, logger._tracking_uri, run_dir)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The model exists only after configure_model, which runs after setup.
        logger = _mlflow_logger(trainer)
        if logger is None or not trainer.is_global_zero:
            return
        facts = {"model.n_parameters": sum(p.numel() for p in pl_module.parameters())}
        for name in ("tokens_per_sample", "flops_per_sample"):
            if hasattr(pl_module, name):
                facts[f"model.{name}"] = getattr(pl_module, name)
        logger.log_hyperparams(facts)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        logger = _mlflow_logger(trainer)
        if logger is not None and trainer.is_global_zero:
            uri = logger._tracking_uri
            how = f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else f"open {uri}"
            log.info("MLflow run %s in experiment %r; to browse runs: %s", logger.run_id, logger._experiment_name, how)


def _mlflow_logger(trainer: Trainer) -> Optional[MLFlowLogger]:
    return next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
