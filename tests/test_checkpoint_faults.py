"""Fault injection: SIGKILL the training process at random moments, some during a checkpoint write, and
rerun the same command until it finishes. The result must be the uninterrupted run's, bit for bit, no
unfinished or corrupt checkpoint may ever be loaded, and MLflow must show one run whose step axis
simply continues."""

import json
import random
import time
from pathlib import Path

import forked_cli
import pytest
import torch
from checkpoint_modules import resume_recipe
from mlflow import MlflowClient

from uma_lightning.checkpoint import committed, read_manifest, verify
from uma_lightning.checkpoint.storage import empty_like_saved, load_tensors, tensor_metadata
from uma_lightning.cli import UmaCLI

MAX_STEPS = 30
ARGS = ["--data.generation.n_episodes", "6", "--data.batch_size", "16", "--data.loader.num_workers", "0"]


def write_recipe(path: Path) -> str:
    progress = {"class_path": "uma_lightning.callbacks.ProgressLog", "init_args": {"every_n_steps": 1}}
    trainer = {
        "max_steps": MAX_STEPS,
        "val_check_interval": 7,
        "limit_val_batches": 1,
        "logger": {"init_args": {"experiment_name": "faults"}},
    }
    return resume_recipe(path, path.parent / "record", [progress], every_n_steps=2, trainer=trainer)


def saved_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    entries = tensor_metadata(checkpoint)
    tensors = {k: empty_like_saved(e) for k, e in entries.items() if k.startswith(("model/", "optimizer/"))}
    load_tensors(tensors, checkpoint, None)
    return tensors


def staging_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(".staging-")] if root.is_dir() else []


def file_stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def assert_committed_checkpoints_are_valid(root: Path) -> None:
    for _, path in committed(root):
        assert verify(path) == [], f"a committed checkpoint is corrupt: {path}"


def test_a_checkpoint_commits_only_after_the_metrics_of_the_steps_before_it_are_stored(tmp_path, monkeypatch):
    """Lightning logs a step's metrics after ``on_train_batch_end``, where the step's checkpoint is
    saved: with a slow tracking store the background writer would commit first, and a SIGKILL in
    between would lose that step's metrics for good (the rerun resumes after it)."""
    from uma_lightning.checkpoint import writer
    from uma_lightning.tracking import mlflow_logger

    recipe = write_recipe(tmp_path / "recipe.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "60")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    stored_at_commit = {}

    def commit(staging: Path, final: Path) -> None:
        (run,) = client.search_runs([client.get_experiment_by_name("faults").experiment_id])
        stored_at_commit[final.name] = {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
        real_commit(staging, final)

    def slow_flush(uri: str) -> None:
        time.sleep(0.5)
        real_flush(uri)

    real_commit, real_flush = writer.commit, mlflow_logger.flush_async_logging
    monkeypatch.setattr(writer, "commit", commit)
    monkeypatch.setattr(mlflow_logger, "flush_async_logging", slow_flush)
    UmaCLI(
        [
            "fit",
            "--config",
            recipe,
            *ARGS,
            "--trainer.max_steps",
            "6",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ]
    )
    assert stored_at_commit == {f"step-{step:09d}": set(range(step)) for step in (2, 4, 6)}


@pytest.mark.slow(seconds=20)
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_then_rerunning_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "recipe.yaml")
    monkeypatch.chdir(tmp_path)  # the MLflow store (./mlruns) of both runs
    reference = UmaCLI(
        [
            "fit",
            "--config",
            recipe,
            *ARGS,
            "--trainer.default_root_dir",
            str(tmp_path / "reference"),
            "--trainer.logger",
            "false",
        ]
    )
    assert reference.trainer.global_step == MAX_STEPS

    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    command = ["fit", "--config", recipe, *ARGS, "--trainer.default_root_dir", str(run_dir)]
    chooser = random.Random(5)
    kills = []  # (attempt, kind, seconds into training, newest committed step before the kill, staging dirs left)
    attempt = 0
    while len(kills) < 4 or not any(kind == "during a write" and left for _, kind, _, _, left in kills):
        assert attempt < 8, f"could not kill during a checkpoint write: {kills}"
        attempt += 1
        process = forked_cli.start(command, tmp_path / f"attempt{attempt}.log", tmp_path)
        kind = "during a write" if attempt % 2 else "at a random moment"
        # Kill only once this attempt has trained (a checkpoint newer than it started from exists),
        # so that every attempt moves the run forward.
        start_step = max([step for step, _ in committed(checkpoints)], default=0)
        deadline = time.monotonic() + 120
        while max([step for step, _ in committed(checkpoints)], default=0) <= start_step:
            assert process.is_alive(), (tmp_path / f"attempt{attempt}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.005)
        began = time.monotonic()
        if kind == "during a write":
            while not staging_dirs(checkpoints) and process.is_alive():
                time.sleep(0.0005)
        else:
            time.sleep(chooser.uniform(0.0, 1.0))
        if not process.is_alive():
            break  # finished before the kill: nothing more to interrupt
        process.kill()  # SIGKILL
        process.join()
        newest = max([step for step, _ in committed(checkpoints)], default=0)
        kills.append(
            (attempt, kind, round(time.monotonic() - began, 3), newest, [p.name for p in staging_dirs(checkpoints)])
        )
        assert_committed_checkpoints_are_valid(checkpoints)
    print("kills:", json.dumps(kills))

    final_log = tmp_path / "final.log"
    assert forked_cli.run(command, final_log, tmp_path, timeout=300) == 0, final_log.read_text()[-3000:]
    assert_committed_checkpoints_are_valid(checkpoints)
    assert not staging_dirs(checkpoints)

    # Every rerun resumed from a committed checkpoint that verified, never from a staging directory,
    # and the one after the last kill trained the rest. A kill's rerun is the next attempt, or the
    # final run where no attempt followed (an attempt that finished before its kill ends the loop).
    # A kill after the last checkpoint committed leaves nothing to train: the rerun says so and changes nothing.
    for attempt, _, _, step_before, _ in kills:
        rerun = tmp_path / f"attempt{attempt + 1}.log"
        text = (rerun if rerun.exists() else final_log).read_text()
        if step_before == MAX_STEPS:
            assert f"this run already reached max_steps {MAX_STEPS} (step-{MAX_STEPS:09d})" in text
        else:
            assert f"resumed from {checkpoints / f'step-{step_before:09d}'}: step {step_before}" in text
    if kills[-1][3] < MAX_STEPS:
        assert f"trained {MAX_STEPS - kills[-1][3]} steps" in text

    final_checkpoint = checkpoints / f"step-{MAX_STEPS:09d}"
    expected = saved_tensors(tmp_path / "reference" / "checkpoints" / f"step-{MAX_STEPS:09d}")
    actual = saved_tensors(final_checkpoint)
    assert actual.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(actual[k], expected[k])] == []

    # One MLflow run for the whole job, finished, with a step axis that continues across restarts.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("faults").experiment_id])
    assert run.info.run_id == read_manifest(final_checkpoint)["mlflow_run_id"]
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    # Every step: those before a checkpoint reached the store before it could be resumed from, and the
    # rest were trained again (and logged again) by the rerun.
    assert {m.step for m in losses} == set(range(MAX_STEPS))

    # A kill after the last checkpoint but before the exit leaves the MLflow run unfinished; the
    # rerun then has nothing to train, must say so, leave the checkpoints alone and finish the run.
    client.set_terminated(run.info.run_id, status="KILLED")
    checkpoints_before = file_stamps(checkpoints)
    rerun_log = tmp_path / "rerun.log"
    assert forked_cli.run(command, rerun_log, tmp_path, timeout=300) == 0, rerun_log.read_text()[-3000:]
    assert f"this run already reached max_steps {MAX_STEPS} (step-{MAX_STEPS:09d}): nothing to train" in (
        rerun_log.read_text()
    )
    assert file_stamps(checkpoints) == checkpoints_before
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == len(losses)
