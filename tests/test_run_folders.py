"""Runs never damage each other: a command in a folder that holds another run's checkpoints is
refused before it touches anything, a finished run rerun is left as it is, and a continued MLflow run
keeps its tags and its status."""

import hashlib
import json
import logging
import shutil

import pytest
from mlflow import MlflowClient
from suite import TINY, assert_short_error, run_main

from uma_lightning.checkpoint.identity import identity_differences
from uma_lightning.tracking import MLflowLogger


def folder_state(cwd) -> dict:
    """Every file of the run folder (content hash and modification time), and every MLflow run of
    the store (status, end time, tags, params)."""
    files = {
        str(path.relative_to(cwd)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted((cwd / "runs").rglob("*"))
        if path.is_file()
    }
    client = MlflowClient(f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = {
        run.info.run_id: (run.info.status, run.info.end_time, run.data.tags, run.data.params)
        for run in client.search_runs(experiments)
    }
    return {"files": files, "runs": runs}


@pytest.fixture
def finished_run(pretrained, tmp_path, monkeypatch):
    """A copy of the session's finished pretrain run (its run folder and MLflow store), as the working directory."""
    assert pretrained.code == 0, pretrained.log[-3000:]
    for name in ("runs", "mlruns"):
        shutil.copytree(pretrained.cwd / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow  # reads the session's pretrain run; each command builds the model and the data first
def test_another_network_in_a_finished_runs_folder_is_refused_before_touching_it(
    finished_run, pretrained, capsys, caplog
):
    before = folder_state(finished_run)
    ((status, *_),) = before["runs"].values()
    assert status == "FINISHED" and "checkpoints" in str(before["files"])
    checkpoints = "runs/pretrain/checkpoints"
    with caplog.at_level(logging.WARNING):
        for changed, named in (
            # The README's quick start, then a research subclass in the same (default) folder.
            (["--model", "research_module.DeeperPretrain"], "model class_path research_module.DeeperPretrain"),
            (["--model.network.size", json.dumps(TINY)], "model.network.size.dim 32 (checkpoint: 192)"),
            (["--data.val_episodes", "5"], "train episodes] (checkpoint: "),
        ):
            code, _, err = run_main([*pretrained.argv, *changed], capsys)
            assert_short_error(code, err, "uma: error:", checkpoints, "holds the checkpoints of another run", named)
            assert "--trainer.default_root_dir" in err and "--model.init_from" in err
    assert "keeps its original values" not in caplog.text
    assert folder_state(finished_run) == before

    # The same command again: the run is done, nothing to do, nothing changed.
    code, _, err = run_main(pretrained.argv, capsys)
    assert code == 0 and err.strip() == (
        f"uma: {(finished_run / checkpoints).resolve()}: this run already reached max_steps {pretrained.steps} "
        f"(step-{pretrained.steps:09d}): nothing to train, its checkpoints are left as they are. To train it "
        "further, raise --trainer.max_steps"
    )
    assert folder_state(finished_run) == before


def test_identity_differences_name_the_model_the_settings_and_the_data():
    data = [{"root": "/a/arm", "digest": "abc", "weight": 1.0, "train_episodes": 20}]
    saved = {"model": "m.Pretrain", "hyperparameters": {"network/size/dim": "64", "n_action_bins": "256"}, "data": data}
    moved = [{**data[0], "root": "s3://bucket/arm"}]
    assert identity_differences(saved, {**saved, "data": moved}) == []  # the same data stored elsewhere
    assert identity_differences(saved, {**saved, "hyperparameters": {"network/size/dim": "64"}}) == []  # newer keys
    other = {
        "model": "r.Deeper",
        "hyperparameters": {"network/size/dim": "32", "n_action_bins": "256"},
        "data": [{**data[0], "digest": "def"}],
    }
    assert identity_differences(saved, other) == [
        "model class_path r.Deeper (checkpoint: m.Pretrain)",
        "model.network.size.dim 32 (checkpoint: 64)",
        "data /a/arm [digest def, 20 train episodes] (checkpoint: /a/arm [digest abc, 20 train episodes])",
    ]


def test_a_continued_run_keeps_its_tags_and_a_finished_status_when_stopped_before_training(tmp_path, caplog):
    store = str(tmp_path / "mlruns")
    first = MLflowLogger(experiment_name="continued", store_dir=store, synchronous=True)
    first.log_tags({"command": "uma fit --config a.yaml", "host": "node1"})
    first.log_metrics({"train/loss": 1.0}, step=1)
    first.finalize("success")
    again = MLflowLogger(experiment_name="continued", store_dir=store, synchronous=True)
    again.continue_run(first.run_id)
    again.log_tags({"command": "uma fit --config b.yaml", "host": "node1", "git.dirty": "true"})
    with caplog.at_level(logging.WARNING):
        again.finalize("failed")  # a checkpoint that would not load, say
    run = MlflowClient(again._tracking_uri).get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert f"MLflow run {first.run_id} keeps its status FINISHED" in caplog.text
    tags = {key: value for key, value in run.data.tags.items() if not key.startswith("mlflow.")}
    assert tags == {
        "command": "uma fit --config a.yaml",
        "host": "node1",
        "git.dirty": "true",
        "resumed.command": "uma fit --config b.yaml",
    }

    # Once it has trained, a failure is the run's own.
    third = MLflowLogger(experiment_name="continued", store_dir=store, synchronous=True)
    third.continue_run(first.run_id)
    third.log_metrics({"train/loss": 0.5}, step=2)
    third.finalize("failed")
    assert MlflowClient(third._tracking_uri).get_run(first.run_id).info.status == "FAILED"
