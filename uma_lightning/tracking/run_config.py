"""Records a run's resolved config, provenance and output locations, in the run directory and in MLflow."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback

from uma_lightning.checkpoint.directory import committed
from uma_lightning.checkpoint.weights import read_checkpoint
from uma_lightning.lightning_compat import mlflow_experiment_name, mlflow_tracking_uri
from uma_lightning.tracking.datasets import dataset_inputs
from uma_lightning.tracking.mlflow_logger import MLflowLogger, find_mlflow_logger
from uma_lightning.tracking.provenance import rank_facts, run_tags, write_provenance
from uma_lightning.tracking.step_metrics import log_step_metrics

log = logging.getLogger(__name__)


def headline_metrics(metrics: dict, key_metric: Optional[str]) -> dict[str, float]:
    """The run's result under ``final/`` names (``final/val_loss``, ``final/val_token_accuracy``):
    the last validation's loss, the stage's key metric and the closed-loop success rate, those
    that were measured. A handful of columns to add in the runs table, the same in every stage."""
    names = ("val/loss", key_metric, "val/success_rate")
    return {
        f"final/{name.replace('/', '_')}": float(metrics[name])
        for name in dict.fromkeys(names)
        if name and name in metrics
    }


def _log_params(logger, params: dict, from_config: bool = False) -> None:
    if isinstance(logger, MLflowLogger):
        logger.log_params(params, from_config=from_config)
    else:
        logger.log_hyperparams(params)


class RecordRunConfig(SaveConfigCallback):
    """Writes ``<run dir>/config.yaml`` and ``<run dir>/provenance/`` (git diff, installed packages,
    chosen environment variables, world layout) and, with an MLflow logger, logs the config as an
    artifact and as flattened params, the datasets as dataset inputs, the provenance files as
    artifacts, tags for commit, versions, hardware and world size, and at the end the headline
    metrics and the trained policy as an MLflow Model. Files are written by global rank zero."""

    def __init__(self, *args, recipe: Optional[str] = None, **kwargs):
        super().__init__(*args, save_to_log_dir=False, **kwargs)
        self.recipe = recipe
        self._world: list[dict] = []
        self._flops_logged = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.already_saved:
            # Every rank says where it runs; a collective, so all ranks take part before rank zero writes.
            facts = rank_facts(trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.strategy.root_device)
            self._world = [facts]
            if dist.is_available() and dist.is_initialized():
                self._world = [None] * dist.get_world_size()
                dist.all_gather_object(self._world, facts)
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / self.config_filename
        self.parser.save(self.config, config_path, skip_none=False, overwrite=True, multifile=False)
        provenance_dir = run_dir / "provenance"
        write_provenance(provenance_dir, self._world)
        logger = find_mlflow_logger(trainer)
        if logger is None:
            return
        _log_params(logger, yaml.safe_load(config_path.read_text()), from_config=True)
        tags = run_tags(trainer.world_size)
        tags["world.nodes"] = str(len({rank["host"] for rank in self._world}))
        tags["world.devices_per_node"] = str(trainer.num_devices)
        tags["strategy"] = type(trainer.strategy).__name__
        tags["precision"] = str(trainer.precision)
        tags["run_dir"] = str(run_dir.resolve())
        tags["stage"] = stage
        if self.recipe:
            tags["recipe"] = self.recipe
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.dirpath:
            tags["checkpoint_dir"] = str(trainer.checkpoint_callback.dirpath)
        if isinstance(logger, MLflowLogger):
            logger.log_tags(tags)
        else:
            from mlflow.entities import RunTag

            logger.experiment.log_batch(logger.run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        datamodule = getattr(trainer, "datamodule", None)
        inputs = dataset_inputs(datamodule) if datamodule is not None else []
        if inputs:
            logger.experiment.log_inputs(logger.run_id, datasets=inputs)
        logger.experiment.log_artifact(logger.run_id, str(config_path))
        logger.experiment.log_artifacts(logger.run_id, str(provenance_dir), "provenance")
        log.info("MLflow run %s (%s), run dir %s", logger.run_id, mlflow_tracking_uri(logger), run_dir)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The model exists only after configure_model, which runs after setup.
        logger = find_mlflow_logger(trainer)
        if logger is None:
            return
        facts = {"model.n_parameters": sum(p.numel() for p in pl_module.parameters())}
        if getattr(pl_module, "tokens_per_sample", None):
            facts["model.tokens_per_sample"] = pl_module.tokens_per_sample
        _log_params(logger, facts)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        # Counted over the first batch's step (``StageModule.count_flops_per_sample``), once.
        if self._flops_logged or not callable(getattr(pl_module, "count_flops_per_sample", None)):
            return
        self._flops_logged = True
        logger = find_mlflow_logger(trainer)
        flops = pl_module.count_flops_per_sample(batch)
        if logger is not None and flops:
            _log_params(logger, {"model.flops_per_sample": flops})

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        logger = find_mlflow_logger(trainer)
        if logger is not None:
            headline = headline_metrics(trainer.callback_metrics, getattr(pl_module, "key_metric", None))
            if headline:
                log_step_metrics(trainer, headline)
            if isinstance(logger, MLflowLogger) and logger.log_policy:
                log_final_policy(trainer, logger)
            uri = mlflow_tracking_uri(logger)
            how = f"mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:") else f"open {uri}"
            log.info(
                "MLflow run %s in experiment %r; to browse runs: %s", logger.run_id, mlflow_experiment_name(logger), how
            )


def log_final_policy(trainer: Trainer, logger: MLflowLogger) -> None:
    """The policy of the fit's newest sharded checkpoint as the run's MLflow Model (``policy_model.py``),
    registered when the logger says so. Lightning's .ckpt files (an RL learner's) hold no robot policy.
    A failure does not undo the training: it is logged with the command that logs the model later."""
    from uma_lightning.tracking.policy_model import log_policy_model  # imports MLflow's model flavours, 0.5 s

    checkpoint_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
    if not checkpoint_dir or not committed(checkpoint_dir):
        return
    logger.flush()  # the headline metrics just logged go with the model
    uri = mlflow_tracking_uri(logger)
    try:
        log_policy_model(
            uri, logger.run_id, read_checkpoint(checkpoint_dir), logger.policy_weights, logger.register_model
        )
    except Exception as err:
        register = f" --register {logger.register_model}" if logger.register_model else ""
        log.error(
            "could not log the policy as an MLflow Model (%s: %s); to log it: "
            "uma ckpt export %s --format mlflow --tracking-uri %s --run-id %s%s",
            type(err).__name__,
            err,
            checkpoint_dir,
            uri,
            logger.run_id,
            register,
        )
