"""The pretrain recipe end to end, as a user runs it: the console script in a fresh directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pretrain_recipe_learns_and_is_tracked(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run(
        [Path(sys.executable).parent / "uma", "fit", "--config", str(REPO / "recipes" / "pretrain.yaml"), "--trainer.max_steps", "60"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 60/60 | loss" in result.stderr
    assert "Traceback" not in result.stderr

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(losses) == 60
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    # Chance level is ln(256) = 5.55 nats per action token; the model must clearly beat its start.
    assert last < first - 0.5, (first, last)
    assert (tmp_path / "runs" / "pretrain" / "checkpoints" / "step-000000060" / "manifest.json").is_file()
    assert run.data.tags["recipe"].endswith("recipes/pretrain.yaml")
