"""Training on a fixed list of global batches, with nothing else attached: the parity tool and the benchmarks use it.

Every run sees the same global batches in the same order; each data-parallel rank trains on its
equal slice of every batch, tensor-parallel ranks on their group's slice.
"""

from __future__ import annotations

import os

import lightning as L
from torch.utils.data import DataLoader

from uma_lightning.ranks import data_parallel_rank


class GlobalBatches(L.LightningDataModule):
    """Each data-parallel rank's equal slice of every global batch, in order; or, on one process,
    all ``micro_batches`` slices of each global batch one after the other."""

    def __init__(self, batches: list[dict], micro_batches: int = 1):
        super().__init__()
        self.batches, self.micro_batches = batches, micro_batches

    def train_dataloader(self) -> DataLoader:
        rank, replicas = data_parallel_rank(self.trainer)
        parts = replicas * self.micro_batches
        size = len(self.batches[0]["sample_id"]) // parts
        first = rank * self.micro_batches
        slices = [
            _rows(b, part * size, (part + 1) * size)
            for b in self.batches
            for part in range(first, first + self.micro_batches)
        ]
        return DataLoader(slices, batch_size=None, collate_fn=_identity)


def fit_on_batches(
    module, batches: list[dict], strategy="auto", callbacks=(), micro_batches: int = 1, **trainer_args
) -> L.Trainer:
    """One optimizer step per global batch (accumulating over ``micro_batches`` slices); no logger,
    checkpoints, progress bar or validation. Runs on the CPU on the processes of a local group
    (``launch.run_local_group``) unless ``trainer_args`` say otherwise."""
    settings = {"accelerator": "cpu", "devices": int(os.environ.get("LOCAL_WORLD_SIZE", 1)), **trainer_args}
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=len(batches),
        accumulate_grad_batches=micro_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
        **settings,
    )
    trainer.fit(module, datamodule=GlobalBatches(batches, micro_batches))
    return trainer


def _rows(batch: dict, start: int, stop: int) -> dict:
    return {key: value[start:stop] for key, value in batch.items()}


def _identity(batch):
    return batch
