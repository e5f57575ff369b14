"""What ShardedCheckpoint saves besides tensors: callbacks' state and checkpoint hooks, as Lightning's
own checkpoints keep them; and a checkpoint whose index the loader refuses, met at resume."""

import json
import logging
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_modules import LinearRegression, RunsCommand
from lightning.pytorch import Callback, Trainer
from suite import QUICK, RECIPE

from uma_lightning.callbacks import ShardedCheckpoint
from uma_lightning.checkpoint.manifest import MANIFEST, describe_files, read_manifest, write_json_durably
from uma_lightning.cli import UmaCLI
from uma_lightning.command import main


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


def re_sign(checkpoint: Path) -> None:
    """Record the files' sizes and checksums as they are now in the manifest, as a forger would."""
    manifest = read_manifest(checkpoint)
    manifest["files"] = describe_files(checkpoint, manifest["files"])
    write_json_durably(checkpoint / MANIFEST, manifest)


def fit(root: Path, max_steps: int) -> tuple[Trainer, NotesSteps, CountsBatches]:
    module, counter = NotesSteps(), CountsBatches()
    trainer = Trainer(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[counter, ShardedCheckpoint(every_n_steps=2)],
        default_root_dir=root,
    )
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
    re_sign(newest)
    trainer, module, counter = fit(tmp_path, max_steps=4)
    assert trainer.checkpoint_callback.resumed_from == newest
    assert module.loaded_extras == {"module_step": 3}
    assert counter.calls == [("on_load_checkpoint", None), ("load_state_dict", 3, [3.0])]


def plant_command_index(checkpoint: Path, marker: Path) -> None:
    """Replace the index by a pickle that would run a command, and re-sign the manifest so the files verify."""
    RunsCommand.marker = marker
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCommand()))
    re_sign(checkpoint)


QUIET = [*QUICK, "--trainer.logger", "false", "--trainer.max_steps", "2"]


def test_a_checkpoint_that_verifies_but_cannot_load_is_skipped_then_refused(tmp_path, capsys, caplog):
    run = ["fit", "--config", RECIPE, *QUIET, "--trainer.default_root_dir", str(tmp_path / "run")]
    UmaCLI(run)  # the checkpoint of step 2, saved on the way out
    checkpoints, marker = tmp_path / "run" / "checkpoints", tmp_path / "pwned"
    # A newer checkpoint whose files match its manifest but whose index the loader refuses.
    shutil.copytree(checkpoints / "step-000000002", checkpoints / "step-000000003")
    plant_command_index(checkpoints / "step-000000003", marker)
    with caplog.at_level(logging.WARNING):
        cli = UmaCLI([*run, "--trainer.max_steps", "4"])
    assert cli.trainer.checkpoint_callback.resumed_from == checkpoints / "step-000000002"
    assert cli.trainer.global_step == 4
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert re.search(
        r"skipping checkpoint .*step-000000003.*\.metadata: not a valid checkpoint index: refusing to load posix\.system",
        warnings,
    )
    # Retention kept steps 3 and 4; `uma ckpt inspect` judges them as the resume does.
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step-000000003", "step-000000004"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "inspect", str(checkpoints)])
    listing = capsys.readouterr().out
    assert exit_info.value.code == 0 and re.search(
        r"step-000000003  step 3 .* UNUSABLE: .*refusing to load posix\.system", listing
    ), listing
    assert f"resume would continue from: {checkpoints / 'step-000000004'}" in listing
    # With neither loadable: one error line and exit status 2, not a traceback.
    plant_command_index(checkpoints / "step-000000004", marker)
    with pytest.raises(SystemExit) as exit_info:
        main([*run, "--trainer.max_steps", "6"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "uma: error" in line]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and re.match(
        rf"uma: error: {re.escape(str(checkpoints))}: none of the 2 checkpoint\(s\) is usable", errors[0]
    ), errors
    assert not marker.exists()
