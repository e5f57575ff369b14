"""The default callbacks read tensors on the host at most once per training step.

On an accelerator every read of a tensor's value (``.item()``, ``float()``, ``.tolist()``, ``.cpu()``)
waits for all the work queued before it, so a callback that reads one per metric stalls each step
several times. This test counts those reads, by the file that makes them, in a short real run.
"""

import collections
import json
import sys
from pathlib import Path

import lightning as L
import torch
from suite import QUICK, RECIPE

import uma_lightning.callbacks as callbacks_package
from uma_lightning.cli import UmaCLI

CALLBACKS_DIR = str(Path(callbacks_package.__file__).resolve().parent)
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
STEPS = 6
READS_BY_STEP: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
CURRENT_STEP = [-1]


class ReadsLossEveryStep(L.Callback):
    """The counter's own check: one read per step it must see."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        outputs["loss"].item()


class NotesStep(L.Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        CURRENT_STEP[0] = trainer.global_step


def counting(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(CALLBACKS_DIR) and not caller.endswith("preemption.py"):
            # Preemption's flag is a CPU tensor reduced over gloo: reading it never waits for a device.
            READS_BY_STEP["callbacks"][CURRENT_STEP[0]] += 1
        elif caller == __file__:
            READS_BY_STEP["probe"][CURRENT_STEP[0]] += 1
        return original(self, *args, **kwargs)

    return read


def test_default_callbacks_read_the_device_once_per_step(tmp_path, monkeypatch, mlflow_store):
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    extra = [{"class_path": f"{__name__}.NotesStep"}, {"class_path": f"{__name__}.ReadsLossEveryStep"}]
    UmaCLI(
        [
            "fit",
            "--config",
            RECIPE,
            *QUICK,
            "--trainer.max_steps",
            str(STEPS),
            "--trainer.limit_val_batches",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger.init_args.store_dir",
            str(mlflow_store),
            "--trainer.callbacks+",
            json.dumps(extra),
        ]
    )
    steady = range(1, STEPS)  # step 0 sets things up (the MFU peak, the first progress figures)
    assert [READS_BY_STEP["probe"][step] for step in steady] == [1] * len(steady)
    # GradientAnomalies' one reduction of loss, gradient norm and finiteness each step; ProgressLog's
    # line after the last step reads its figures in one more.
    assert [READS_BY_STEP["callbacks"][step] for step in steady] == [1, 1, 1, 1, 2]
