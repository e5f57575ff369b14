"""The pretrain recipe end to end, as a user runs it: a fresh directory, its own process (the session's
``pretrained`` run, which the pipeline test continues from)."""

import pytest
from mlflow import MlflowClient


@pytest.mark.slow
def test_pretrain_recipe_learns_and_is_tracked(pretrained):
    steps = pretrained.steps
    assert pretrained.code == 0, pretrained.log[-3000:]
    assert f"step {steps}/{steps} | loss" in pretrained.log
    assert "Traceback" not in pretrained.log

    client = MlflowClient(pretrained.store)
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(losses) == steps
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    # Chance level is ln(256) = 5.55 nats per action token; the model must clearly beat its start.
    assert last < first - 0.5, (first, last)
    assert (pretrained.checkpoints / f"step-{steps:09d}" / "manifest.json").is_file()
    assert run.data.tags["recipe"].endswith("recipes/pretrain.yaml")
