"""Checkpoint format: atomic commits, manifests that catch corruption, retention, loading without pickle."""

import logging
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import backbone, full_state, optimizer_for, save_module, train_step
from checkpoint_modules import RunsCommand
from suite import REPO

from uma_lightning.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    choose_checkpoint,
    committed,
    read_manifest,
    steps_to_keep,
    verify,
)
from uma_lightning.checkpoint.codec import decode, encode
from uma_lightning.checkpoint.state import load_module
from uma_lightning.checkpoint.storage import tensor_metadata
from uma_lightning.command import main


def trained(seed: int = 0, steps: int = 2):
    model = backbone(seed)
    optimizer = optimizer_for(model)
    for step in range(steps):
        train_step(model, optimizer, seed=step)
    return model, optimizer


def test_codec_round_trips_plain_state_and_refuses_objects():
    state = {
        "progress": {"total": {"ready": 3}, "is_last": False, "ratio": 0.1, "nothing": None},
        "betas": (0.9, 0.95),
        "by_int": {0: "a", 3: [1, 2]},
        "scale": torch.tensor(2.0**16),
        "nested": [{"t": torch.arange(3)}, "x"],
        "np": np.float32(1.5),
        "tagged": {"__tensor__": "not a reference"},
    }
    encoded, tensors = encode(state, "trainer")
    assert set(tensors) == {"trainer/scale", "trainer/nested/0/t"}
    import json

    decoded = decode(json.loads(json.dumps(encoded)), tensors)
    assert decoded["betas"] == (0.9, 0.95) and isinstance(decoded["betas"], tuple)
    assert decoded["by_int"] == {0: "a", 3: [1, 2]}
    assert decoded["progress"] == state["progress"] and decoded["tagged"] == state["tagged"]
    assert decoded["scale"] is state["scale"] and decoded["np"] == 1.5
    with pytest.raises(TypeError, match=r"trainer/callbacks/Mine/path: a PosixPath cannot be stored"):
        encode({"callbacks": {"Mine": {"path": Path("/tmp")}}}, "trainer")


def test_retention_keeps_the_last_k_and_every_nth_for_good():
    steps = [100, 200, 300, 400, 500, 600]
    assert steps_to_keep(steps, keep_last=2, keep_every_n_steps=None) == {500, 600}
    assert steps_to_keep(steps, keep_last=2, keep_every_n_steps=250) == {500, 600}
    assert steps_to_keep(steps, keep_last=1, keep_every_n_steps=200) == {200, 400, 600}


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_commit_verified_checkpoints_that_load_back_exactly(tmp_path, async_save):
    model, optimizer = trained()
    for step in (1, 2, 3):
        save_module(tmp_path, step, model, optimizer, async_save=async_save, keep_last=2)
    assert [step for step, _ in committed(tmp_path)] == [2, 3]  # step 1 pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000003"]  # no staging left
    newest = tmp_path / "step-000000003"
    manifest = read_manifest(newest)
    assert manifest["step"] == 3 and set(manifest["files"]) == {".metadata", "__0_0.distcp", "state.json"}
    assert verify(newest) == []
    fresh, fresh_optimizer = trained(seed=1, steps=1)
    load_module(fresh, newest, [fresh_optimizer])
    expected, loaded = full_state(model, optimizer), full_state(fresh, fresh_optimizer)
    assert expected.keys() == loaded.keys() and all(torch.equal(expected[k], loaded[k]) for k in expected)


def test_a_failed_background_write_is_raised_not_lost(tmp_path):
    model, optimizer = trained(steps=1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = CheckpointWriter(blocker / "checkpoints", 2, None, async_save=True, process_group=None)
    state, tensors = {"optimizer": {}}, {"model/w": torch.ones(2)}
    writer.save(1, state, tensors, {})
    with pytest.raises(Exception, match="Not a directory"):
        writer.wait()


def corrupt_byte(path: Path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_unusable_checkpoints_are_reported_and_the_previous_one_is_used(tmp_path, caplog):
    model, optimizer = trained(steps=1)
    for step in (1, 2, 3, 4):
        save_module(tmp_path, step, model, optimizer)
    corrupt_byte(tmp_path / "step-000000004" / "__0_0.distcp")  # bit rot
    (tmp_path / "step-000000003" / "manifest.json").unlink()  # the save never finished
    with open(tmp_path / "step-000000002" / "__0_0.distcp", "r+b") as file:  # truncated
        file.truncate(100)
    (tmp_path / ".staging-step-000000005").mkdir()  # an interrupted save: never a candidate
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(tmp_path) == tmp_path / "step-000000001"
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert re.search(r"step-000000004.*checksum \w+ does not match", warnings)
    assert re.search(r"step-000000003.*no manifest\.json", warnings)
    assert re.search(r"step-000000002.*100 bytes, the manifest says", warnings)
    corrupt_byte(tmp_path / "step-000000001" / "state.json", offset=10)
    with pytest.raises(CheckpointError, match="none of the 4 checkpoint"):
        choose_checkpoint(tmp_path)


def test_loading_never_unpickles_objects(tmp_path):
    model, optimizer = trained(steps=1)
    save_module(tmp_path, 1, model, optimizer)
    checkpoint = tmp_path / "step-000000001"
    # A checkpoint index that would run a command if it were unpickled.
    RunsCommand.marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCommand()))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: not a valid checkpoint index: refusing to load posix.system"
    ):
        load_module(backbone(), checkpoint)
    assert not RunsCommand.marker.exists()
    # Entries that torch.distributed.checkpoint stores as pickled bytes are refused too.
    dcp.save({"model/w": torch.ones(2), "trainer/obj": {"a": "b"}}, checkpoint_id=tmp_path / "bytes", no_dist=True)
    with pytest.raises(CheckpointError, match=r"entries \['trainer/obj\.a'\] are pickled objects"):
        tensor_metadata(tmp_path / "bytes")


def test_torch_load_is_weights_only_everywhere():
    calls = []
    for folder in ("uma_lightning", "callbacks", "kernels"):
        for source in (REPO / folder).rglob("*.py"):
            calls += [(source, call) for call in re.findall(r"torch\.load\([^)]*\)", source.read_text())]
    assert all("weights_only=True" in call for _, call in calls), [c for c in calls if "weights_only=True" not in c[1]]


def test_ckpt_inspect_reports_status_step_and_shapes(tmp_path, capsys):
    model, optimizer = trained(steps=1)
    save_module(tmp_path, 7, model, optimizer)
    save_module(tmp_path, 9, model, optimizer)
    checkpoint = tmp_path / "step-000000007"
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "inspect", str(checkpoint)])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "manifest: valid (3 files" in out and "step 7, epoch 0, saved by 1 process(es)" in out
    assert re.search(r"model/layers\.0\.attn\.wq\.weight\s+\[16, 16\]\s+float32", out)
    corrupt_byte(tmp_path / "step-000000009" / "__0_0.distcp")
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "inspect", str(tmp_path)])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert re.search(r"step-000000007  step 7  [\d.]+ MB  valid", out)
    assert re.search(r"step-000000009  step 9  \?  UNUSABLE: .*checksum", out)
    assert f"resume would continue from: {checkpoint}" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "inspect", str(tmp_path / "step-000000009")])
    assert exit_info.value.code == 1 and "UNUSABLE, it would never be loaded" in capsys.readouterr().out
