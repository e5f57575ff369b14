"""Gradient anomalies, injected into real training runs: a NaN batch is caught in its own step and
skipped, a loss spike triggers its configured action, a rollback returns to the last checkpoint
and leaves the offending samples out."""

import contextlib
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoint_helpers import checkpoint_tensors
from faults import Arrivals, Probe
from mlflow import MlflowClient
from suite import QUICK, RECIPE

from uma_lightning.callbacks.anomalies import RollingZScore
from uma_lightning.cli import UmaCLI
from uma_lightning.command import main
from uma_lightning.parallel.grad_norm import clip_grad_norm, gradient_norms
from uma_lightning.tracking.mlflow_logger import local_store_uri

NAN_STEP, SPIKE_STEP = 3, 13


def callbacks(*specs) -> str:
    return json.dumps([{"class_path": path, "init_args": args} for path, args in specs])


def uma_args(run_dir: Path, store: Path, experiment: str, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        RECIPE,
        *QUICK,
        "--model",
        "faults.FaultyPretrain",
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.logger.init_args.store_dir",
        str(store),
        "--trainer.logger.init_args.experiment_name",
        experiment,
        *extra,
    ]


def only_run(store: Path, experiment: str):
    client = MlflowClient(local_store_uri(store))
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


@pytest.fixture(scope="module")
def halted(tmp_path_factory, mlflow_store):
    """NaN in the batch of step 3 (action: skip), then the loss times 20 at step 13 (action: halt)."""
    run_dir = tmp_path_factory.mktemp("anomalies") / "run"
    args = uma_args(
        run_dir,
        mlflow_store,
        "anomalies",
        "--model.nan_at_step",
        str(NAN_STEP),
        "--model.spike_at_step",
        str(SPIKE_STEP),
        "--trainer.max_steps",
        "20",
        "--trainer.val_check_interval",
        "100",
        "--trainer.callbacks",
        callbacks(
            (
                "uma_lightning.callbacks.GradientAnomalies",
                {
                    "nonfinite_action": "skip",
                    "loss_spike_action": "halt",
                    "grad_norm_spike_action": "warn",
                    "min_history": 6,
                    "window": 32,
                },
            ),
            ("faults.Probe", {"steps": [NAN_STEP, SPIKE_STEP]}),
        ),
    )
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(stderr):
        main(args)
    client, run = only_run(mlflow_store, "anomalies")
    events = [json.loads(line) for line in (run_dir / "anomalies.jsonl").read_text().splitlines()]
    return SimpleNamespace(
        code=exit_info.value.code,
        stderr=stderr.getvalue(),
        client=client,
        run=run,
        events=events,
        dir=run_dir,
        probe=Probe.records,
        tmp=run_dir.parent,
    )


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_batch_is_caught_in_its_step_skipped_and_training_goes_on(halted):
    nan_event = halted.events[0]
    assert nan_event["step"] == NAN_STEP and nan_event["kinds"] == ["nonfinite"] and nan_event["action"] == "skip"
    assert nan_event["loss"] == "nan" and nan_event["grad_norm"] == "nan"
    # The batch's samples, and parameters that really exist, named as culprits.
    assert nan_event["sample_ids"] == sorted(halted.probe["sample_ids"][NAN_STEP])
    names = {c["parameter"] for c in nan_event["culprits"]}
    assert len(names) == 5 and all(c["grad_norm"] == "nan" for c in nan_event["culprits"])
    assert names <= set(halted.probe["before"][NAN_STEP])
    # Skipped: the step left every weight as it was; training went on, with finite weights.
    before, after = halted.probe["before"][NAN_STEP], halted.probe["after"][NAN_STEP]
    assert same_weights(before, after)
    assert not same_weights(after, halted.probe["before"][SPIKE_STEP])
    assert all(torch.isfinite(w).all() for w in halted.probe["before"][SPIKE_STEP].values())
    # In MLflow: the metric at its step, the true (NaN) grad_norm, and the event as an artifact.
    client, run_id = halted.client, halted.run.info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "anomaly/nonfinite")] == [(NAN_STEP, 1.0)]
    grad_norms = {m.step: m.value for m in client.get_metric_history(run_id, "grad_norm")}
    assert math.isnan(grad_norms[NAN_STEP]) and math.isfinite(grad_norms[NAN_STEP + 1])
    artifact = client.download_artifacts(run_id, f"anomalies/step{NAN_STEP:07d}_nonfinite.json", str(halted.tmp))
    assert json.loads(Path(artifact).read_text()) == nan_event


def test_loss_spike_triggers_the_configured_action(halted):
    assert [e["step"] for e in halted.events] == [NAN_STEP, SPIKE_STEP]  # no false alarm in between
    spike = halted.events[1]
    assert "loss_spike" in spike["kinds"] and spike["action"] == "halt"
    assert spike["z_scores"]["loss"] > 6
    # halt: `uma fit` exits with status 3 and one line, before the update; the run is marked failed.
    assert halted.code == 3
    assert f"uma: training halted: loss_spike + grad_norm_spike at step {SPIKE_STEP}" in halted.stderr
    assert "Traceback" not in halted.stderr
    assert SPIKE_STEP not in halted.probe["after"]  # the step never finished
    assert halted.run.info.status == "FAILED"
    client, run_id = halted.client, halted.run.info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "anomaly/loss_spike")] == [SPIKE_STEP]
    z = {m.step: m.value for m in client.get_metric_history(run_id, "anomaly/loss_z")}
    assert max(z.values()) == pytest.approx(spike["z_scores"]["loss"]) and max(z, key=z.get) == SPIKE_STEP


# ---- rollback -----------------------------------------------------------------------------------


def test_rollback_returns_to_the_last_checkpoint_and_skips_the_batch(tmp_path, mlflow_store):
    run_dir, rollback_step, max_steps = tmp_path / "run", 5, 20
    cli = UmaCLI(
        uma_args(
            run_dir,
            mlflow_store,
            "rollback",
            "--model.nan_at_step",
            str(rollback_step),
            "--data.val_episodes",
            "5",  # one training episode: its samples come round again within a few steps
            "--trainer.max_steps",
            str(max_steps),
            "--trainer.val_check_interval",
            "100",
            "--trainer.callbacks",
            callbacks(
                ("faults.Arrivals", {}),
                ("uma_lightning.callbacks.GradientAnomalies", {"nonfinite_action": "rollback"}),
                ("faults.Probe", {"steps": [rollback_step]}),
                (
                    "uma_lightning.callbacks.ShardedCheckpoint",
                    {"every_n_steps": 3, "keep_last": 100, "async_save": False},
                ),
            ),
        )
    )
    (event,) = [json.loads(line) for line in (run_dir / "anomalies.jsonl").read_text().splitlines()]
    assert event["step"] == rollback_step and event["action"] == "rollback"
    blocked = set(cli.model.poisoned[rollback_step])
    assert set(event["sample_ids"]) == blocked

    # Right after the step: the weights and the step counter are those of the step-3 checkpoint.
    saved = checkpoint_tensors(run_dir / "checkpoints" / "step-000000003")
    assert Probe.records["global_step_after"][rollback_step] == 3
    assert same_weights(
        Probe.records["after"][rollback_step],
        {k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")},
    )
    # Training resumed at step 3 and ran to max_steps: steps 3..5 were trained twice.
    steps = [step for step, _ in cli.model.trained]
    assert steps == list(range(rollback_step + 1)) + list(range(3, max_steps))
    assert cli.trainer.global_step == max_steps

    # The poisoned samples arrived again in later batches, and were left out of training every time.
    index = steps.index(rollback_step)
    arrived_later = {i for _, ids in Arrivals.records[index + 1 :] for i in ids}
    trained_later = {i for _, ids in cli.model.trained[index + 1 :] for i in ids}
    assert blocked & arrived_later, "the test needs the poisoned samples to come round again"
    assert not blocked & trained_later
    assert cli.trainer.callbacks[1].state_dict()["blocked_samples"] == sorted(blocked)

    # MLflow shows the rollback: the rolled-back steps were logged again on the restored axis.
    client, run = only_run(mlflow_store, "rollback")
    loss_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert loss_steps == sorted(list(range(rollback_step + 1)) + list(range(3, max_steps)))


def test_rolling_z_score_needs_history_and_ignores_a_flat_series():
    z = RollingZScore(window=4, min_history=3)
    for value in (1.0, 2.0):
        z.add(value)
    assert z.score(10.0) is None  # not enough history yet
    z.add(3.0)
    assert z.score(2.0) == pytest.approx(0.0) and z.score(2.0 + math.sqrt(2 / 3)) == pytest.approx(1.0)
    for _ in range(4):
        z.add(5.0)
    assert z.score(6.0) is None  # no spread: no z-score rather than an infinite one


def test_the_detector_and_clipping_take_a_steps_gradient_norms_once(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model(torch.randn(4, 8)).square().sum().backward()
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    expected = torch.nn.utils.get_total_norm(grads)
    measured = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(
        torch, "_foreach_norm", lambda tensors, *args: measured.append(len(tensors)) or foreach_norm(tensors, *args)
    )
    per_parameter = gradient_norms(grads)  # what the anomaly detector takes, before clipping
    assert torch.equal(clip_grad_norm(parameters, math.inf), expected)  # bit for bit torch's total
    assert measured == [len(grads)] and torch.equal(torch.stack(per_parameter), torch.stack(foreach_norm(grads)))
    parameters[0].grad.mul_(2)  # gradients changed since: measured again
    total = clip_grad_norm(parameters, math.inf)
    assert measured == [len(grads)] * 2 and torch.equal(total, torch.nn.utils.get_total_norm(grads))
