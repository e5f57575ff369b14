"""The three training stages end to end, as a user runs them with the shipped recipes at the tiny
size: pretrain (1 process, the session's ``pretrained`` run) -> midtrain (2 processes, FSDP) ->
posttrain (2 processes, FSDP), each stage starting from the previous stage's checkpoint; then the
post-trained checkpoint in a Policy, test, predict, and a mismatched checkpoint.

One-process commands run in this process (``uma_lightning.command.main``), which saves the seconds each
new Python process spends importing; the two ranks of the multi-process commands are forked (``forked_cli``)."""

import logging
import re
from pathlib import Path

import forked_cli
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from suite import STAGE_DATA, recipe

from uma_lightning import Policy
from uma_lightning.checkpoint.weights import read_checkpoint
from uma_lightning.command import main


def uma_here(*args, caplog, expect: int = 0) -> str:
    """Run ``uma ARGS`` in this process; returns what it logged."""
    caplog.clear()
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code or 0
    assert code == expect, caplog.text[-4000:]
    return caplog.text


def uma_ranks(*args, cwd: Path) -> str:
    """Run ``uma ARGS`` as the two ranks of one job, forked; returns what they printed."""
    log = cwd / "ranks.log"
    codes = forked_cli.run_as_ranks(list(args), log, cwd, timeout=900)
    output = log.read_text()
    assert codes == [0, 0], output[-4000:]
    assert "Traceback" not in output
    return output


def fit_args(name: str, steps: int, *args) -> list[str]:
    return [
        "fit",
        "--config",
        recipe(name),
        *STAGE_DATA,
        "--trainer.max_steps",
        str(steps),
        "--trainer.val_check_interval",
        str(steps),
        *args,
    ]


def checkpoint(cwd: Path, name: str) -> Path:
    """A stage's checkpoints directory, which means its newest valid checkpoint."""
    path = cwd / "runs" / name / "checkpoints"
    assert path.is_dir(), f"no checkpoints of {name}"
    return path


def metrics(cwd: Path, experiment: str, having: str) -> dict[str, float]:
    """The metrics of the one run in ``experiment``, in ``cwd``'s MLflow store, that logged the metric ``having``."""
    client = MlflowClient(f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (run,) = [run for run in runs if having in run.data.metrics]
    return run.data.metrics


def first_steps_mse(values: dict[str, float], steps: int = 8) -> float:
    """Held-out action MSE over the first chunk steps, which every stage predicts."""
    return sum(values[f"val/action_mse/step_{k}"] for k in range(steps)) / steps


@pytest.mark.slow(seconds=120)
def test_pretrain_midtrain_posttrain_pipeline(pretrained, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    assert pretrained.code == 0, pretrained.log[-4000:]
    pretrain_checkpoints = checkpoint(pretrained.cwd, "pretrain")
    log = uma_ranks(
        *fit_args("midtrain", 6, "--model.init_from", str(pretrain_checkpoints), "--data.batch_size", "8"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "fsdp",
        cwd=tmp_path,
    )
    assert "training: 6 steps, 2 process(es)" in log and "strategy: FSDP" in log
    assert re.search(
        rf"initialised RobotTransformer from {pretrain_checkpoints}/step-{pretrained.steps:09d} \(raw weights\): \d+ tensors loaded, 0 new \(none\), 0 dropped",
        log,
    )
    assert "context: 1 -> 2 observation steps, 8 -> 16-step action chunks; backbone RoPE positions 0..208" in log
    midtrained = checkpoint(tmp_path, "midtrain")
    log = uma_ranks(
        # Evaluated deterministically, from the noise's mean, as the pretrained model decodes greedily:
        # MSE rewards the mean, and sampling noise would add its variance to one side only.
        *fit_args(
            "posttrain",
            30,
            "--model.init_from",
            str(midtrained),
            "--data.batch_size",
            "16",
            "--trainer.callbacks.n_episodes",
            "4",
            "--model.flow.noise_scale",
            "0",
        ),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "fsdp",
        cwd=tmp_path,
    )
    assert "training: 30 steps, 2 process(es)" in log and "parallel plan robot on RobotFlowTransformer: FSDP" in log
    assert (
        f"initialised RobotFlowTransformer from {midtrained}/step-000000006 (raw weights)" in log
        and "3 dropped (action_dim_embed, action_embed, action_head)" in log
    )
    assert "closed loop (val): success" in log
    posttrained = checkpoint(tmp_path, "posttrain")

    # Post-training beats the pretrained model on the held-out episodes, in robot units.
    before, after = metrics(pretrained.cwd, "pretrain", "train/loss"), metrics(tmp_path, "posttrain", "train/loss")
    print(
        f"held-out action MSE, first 8 chunk steps: pretrained {first_steps_mse(before):.4f}, post-trained {first_steps_mse(after):.4f}"
    )
    assert first_steps_mse(after) < 0.8 * first_steps_mse(before)
    assert 0.0 <= after["val/success_rate"] <= 1.0 and "val/action_mse/gripper" in after

    # The FSDP checkpoint loads whole into a Policy on one process: the EMA weights, bit for bit.
    saved = read_checkpoint(posttrained)
    policy_weights = Policy.from_checkpoint(str(posttrained)).model.state_dict()
    assert saved.ema and policy_weights.keys() == saved.weights.keys()
    assert all(torch.equal(policy_weights[name], saved.weights[name]) for name in saved.weights)

    # `uma test` reports the same metrics on the held-out episodes, to MLflow.
    uma_here(
        "test",
        "--config",
        recipe("posttrain"),
        *STAGE_DATA,
        "--model.init_from",
        str(posttrained),
        "--trainer.callbacks.n_episodes",
        "2",
        caplog=caplog,
    )
    tested = metrics(tmp_path, "posttrain", "test/action_mse")
    assert {"test/action_l1/dq2", "test/action_mse/step_15", "test/success_rate"} <= set(tested)

    # `uma predict` writes a row per held-out frame.
    uma_here(
        "predict", "--config", recipe("posttrain"), *STAGE_DATA, "--model.init_from", str(posttrained), caplog=caplog
    )
    predictions = pq.read_table(tmp_path / "runs" / "posttrain" / "predictions" / "val-rank0.parquet")
    assert predictions.num_rows > 0 and len(predictions.column("predicted_actions")[0]) == 16

    # A checkpoint of another model family stops mid-training before it starts, listing the keys.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", recipe("midtrain"), *STAGE_DATA, "--model.init_from", str(posttrained)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "uma: error: model.init_from:" in err and "cannot initialise RobotTransformer" in err
    assert "missing from the checkpoint: action_dim_embed.weight, action_embed.weight, action_head.weight" in err
    assert "not in this model: action_in.bias" in err
