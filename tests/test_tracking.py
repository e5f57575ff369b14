"""MLflow tracking against a real `mlflow server` on 127.0.0.1, read back through the MLflow client."""

import logging
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from suite import QUICK, RECIPE, assert_short_error, free_port, run_main
from uma_lightning.cli import UmaCLI
from uma_lightning.tracking import MLflowLogger


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [
            shutil.which("mlflow", path=str(Path(sys.executable).parent)), "server",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield url
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.mark.slow  # a server process
def test_run_is_tracked_on_a_real_server(mlflow_server, tmp_path):
    run_dir = tmp_path / "run"
    cli = UmaCLI(
        [
            "fit", "--config", RECIPE, *QUICK,
            "--trainer.default_root_dir", str(run_dir),
            "--trainer.logger.init_args.tracking_uri", mlflow_server,
            "--trainer.logger.init_args.experiment_name", "tracking-test",
        ]
    )
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracking-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_id == cli.trainer.logger.run_id
    assert run.info.status == "FINISHED"

    # The resolved config, flattened into params.
    params = run.data.params
    assert params["trainer/max_steps"] == "4"
    assert params["model/init_args/size/dim"] == "32"
    assert params["data/init_args/batch_size"] == "4"
    assert int(params["model.n_parameters"]) == sum(p.numel() for p in cli.model.parameters())

    # Per-step metrics on the step axis.
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == [0, 1, 2, 3]
    assert float(cli.trainer.callback_metrics["train/loss"]) == pytest.approx(max(losses, key=lambda m: m.step).value)
    for name in ("lr", "grad_norm", "throughput/tokens_per_sec", "throughput/samples_per_sec", "val/loss"):
        assert client.get_metric_history(run.info.run_id, name), f"metric {name} missing"
    tokens = client.get_metric_history(run.info.run_id, "throughput/tokens_per_sec")
    samples = client.get_metric_history(run.info.run_id, "throughput/samples_per_sec")
    assert tokens[-1].value == pytest.approx(samples[-1].value * cli.model.tokens_per_sample)

    # Provenance tags and the checkpoint location.
    tags = run.data.tags
    assert tags["recipe"] == RECIPE
    assert tags["world_size"] == "1"
    assert tags["version.torch"].startswith("2.")
    assert tags["git.dirty"] in ("true", "false") and len(tags["git.commit"]) == 40
    assert Path(tags["checkpoint_dir"]) == (run_dir / "checkpoints").resolve()
    assert (Path(tags["checkpoint_dir"]) / "step-000000004" / "manifest.json").is_file()

    # The config artifact is the run directory's config.yaml, byte for byte; provenance files beside it.
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml", "provenance"]
    assert "pip_freeze.txt" in [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "provenance")]
    downloaded = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert Path(downloaded).read_bytes() == (run_dir / "config.yaml").read_bytes()
    assert yaml.safe_load(Path(downloaded).read_text())["trainer"]["max_steps"] == 4


def test_default_store_is_embedded_sqlite_without_a_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    UmaCLI(["fit", "--config", RECIPE, *QUICK])
    store = tmp_path / "mlruns" / "mlflow.db"
    assert store.is_file()
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 4
    assert (tmp_path / "runs" / "pretrain" / "config.yaml").is_file()
    artifact_dir = Path(run.info.artifact_uri.removeprefix("file://"))
    assert (artifact_dir / "config.yaml").is_file() and artifact_dir.is_relative_to(tmp_path / "mlruns")


def test_a_bad_metric_batching_interval_is_refused_before_any_metric_is_lost(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "5s")
    with pytest.raises(ValueError, match=r"MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS must be a whole number of seconds .* got '5s'"):
        MLflowLogger(store_dir=str(tmp_path / "mlruns"))
    # Through `uma`: a short error naming the variable, exit status 2, no traceback.
    code, _, err = run_main(["fit", "--config", RECIPE, *QUICK, "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert_short_error(code, err, "$MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS must be a whole number of seconds", "'5s'")


def test_a_continued_run_keeps_its_params_when_the_resumed_config_changed(tmp_path, caplog):
    first = MLflowLogger(experiment_name="resume", store_dir=str(tmp_path / "mlruns"), synchronous=True)
    first.log_hyperparams({"trainer": {"max_steps": 100, "precision": "32-true"}})
    first.log_metrics({"train/loss": 1.0}, step=99)
    first.finalize("failed")  # a preempted job
    again = MLflowLogger(experiment_name="resume", store_dir=str(tmp_path / "mlruns"), synchronous=True)
    again.continue_run(first.run_id)
    with caplog.at_level(logging.WARNING):
        again.log_hyperparams({"trainer": {"max_steps": 200, "precision": "32-true"}, "model.n_parameters": 5})
    again.log_metrics({"train/loss": 0.5}, step=100)
    again.finalize("success")
    client = MlflowClient(again._tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"trainer/max_steps": "100", "trainer/precision": "32-true", "model.n_parameters": "5"}
    assert run.data.tags["params_changed_on_resume"] == "trainer/max_steps"
    assert "keeps its original values of changed params: trainer/max_steps" in caplog.text
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [99, 100]
