"""What ShardedCheckpoint saves besides tensors: callbacks' state and checkpoint hooks, as Lightning's
own checkpoints keep them."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from checkpoint_modules import LinearRegression
from uma_lightning.callbacks import ShardedCheckpoint
from uma_lightning.checkpoint.manifest import MANIFEST, describe_files, read_manifest, write_json_durably


class NotesSteps(LinearRegression):
    loaded_extras = None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["module_step"] = self.trainer.global_step

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extras = dict(checkpoint)


class CountsBatches(Callback):
    """State through ``state_dict``, and a note of its own through ``on_save_checkpoint``; records what a resume gave back."""

    def __init__(self):
        self.batches = 0
        self.calls = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches, "seen": torch.tensor([float(self.batches)])}

    def load_state_dict(self, state_dict):
        self.calls.append(("load_state_dict", state_dict["batches"], state_dict["seen"].tolist()))
        self.batches = state_dict["batches"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["counter_note"] = f"saved after {self.batches} batches"

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.calls.append(("on_load_checkpoint", checkpoint.get("counter_note")))


def fit(root: Path, max_steps: int) -> tuple[Trainer, NotesSteps, CountsBatches]:
    module, counter = NotesSteps(), CountsBatches()
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      callbacks=[counter, ShardedCheckpoint(every_n_steps=2)], default_root_dir=root)
    trainer.fit(module)
    return trainer, module, counter


def test_callbacks_state_and_hooks_survive_a_resume(tmp_path):
    trainer, _, counter = fit(tmp_path, max_steps=3)  # saves at step 2, and step 3 on the way out
    assert counter.batches == 3 and counter.calls == []
    trainer, module, counter = fit(tmp_path, max_steps=5)
    assert trainer.checkpoint_callback.resumed_from.name == "step-000000003"
    # In Lightning's order: the module's hook, then the callback's hook, then its state.
    assert module.loaded_extras == {"counter_note": "saved after 3 batches", "module_step": 3}
    assert counter.calls == [("on_load_checkpoint", "saved after 3 batches"), ("load_state_dict", 3, [3.0])]
    assert counter.batches == 5  # 3 restored, 2 more counted


def test_checkpoints_from_before_callbacks_hooks_were_saved_still_resume(tmp_path):
    fit(tmp_path, max_steps=3)
    newest = tmp_path / "checkpoints" / "step-000000003"
    state = json.loads((newest / "state.json").read_text())
    state["trainer"]["module"] = {"module_step": state["trainer"].pop("hooks")["module_step"]}  # the old layout
    (newest / "state.json").write_text(json.dumps(state))
    manifest = read_manifest(newest)
    manifest["files"] = describe_files(newest, manifest["files"])
    write_json_durably(newest / MANIFEST, manifest)
    trainer, module, counter = fit(tmp_path, max_steps=4)
    assert trainer.checkpoint_callback.resumed_from == newest
    assert module.loaded_extras == {"module_step": 3}
    assert counter.calls == [("on_load_checkpoint", None), ("load_state_dict", 3, [3.0])]
