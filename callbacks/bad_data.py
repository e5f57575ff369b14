"""The running count of samples the loader left out as bad (`on_bad_data: skip`), as `data/bad_samples`.

Skipping keeps a run alive past a corrupt file; this count keeps the skipping visible.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer


class BadDataCounter(Callback):
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        bad = getattr(trainer.train_dataloader, "bad_samples", None)
        if bad is not None:
            pl_module.log("data/bad_samples", float(bad), batch_size=len(batch["sample_id"]))
