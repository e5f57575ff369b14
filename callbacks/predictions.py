"""Writes what ``uma predict`` predicts: one parquet file per process with a row per frame.

Columns: ``episode_index``, ``frame_index``, ``predicted_actions`` and ``target_actions`` (the
recorded chunk), both ``[horizon][action_dim]`` lists in robot units, and ``action_mask``
(False on chunk steps past the episode end, where the target repeats the last action).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

log = logging.getLogger("uma_lightning")


class PredictionWriter(BasePredictionWriter):
    def __init__(self, output_dir: Optional[str] = None):
        """
        Args:
            output_dir: Folder of the files; None: ``predictions/`` in the run directory.
        """
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(self, trainer: Trainer, pl_module: LightningModule, predictions, batch_indices) -> None:
        batches = predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        if not batches:
            return
        columns = {key: torch.cat([batch[key].cpu() for batch in batches]) for key in batches[0]}
        table = pa.table({key: pa.array(value.tolist()) for key, value in columns.items()})
        datamodule = trainer.datamodule
        split = datamodule.hparams.get("predict_split", "predict") if datamodule is not None else "predict"
        folder = Path(self.output_dir or Path(trainer.default_root_dir) / "predictions")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{split}-rank{trainer.global_rank}.parquet"
        pq.write_table(table, path)
        log.info("wrote %d predictions for the %s split to %s", table.num_rows, split, path)
