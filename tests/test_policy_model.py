"""The trained policy as an MLflow Model, against a real `mlflow server` on 127.0.0.1: logged and
registered at the end of fit and by `uma ckpt export --format mlflow`, then loaded, predicted with
`mlflow models predict` and served with `mlflow models serve`; every answer compared with `Policy`."""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file
from suite import QUICK, RECIPE, REPO, run_main

from uma_lightning.checkpoint.weights import read_checkpoint
from uma_lightning.cli import UmaCLI
from uma_lightning.policy import Policy
from uma_lightning.tools.ckpt import main as ckpt

sys.path.insert(0, str(REPO / "benchmarks"))
from mlflow_serve import observations, serve_and_compare  # noqa: E402  (the benchmark's own client)

FIT_NAME, EXPORT_NAME = "fit-policy", "exported-policy"


@pytest.fixture(scope="module")
def registered_fit(mlflow_server, tmp_path_factory):
    """A quick pretrain run on the server whose config registers its policy: (run id, checkpoints)."""
    run_dir = tmp_path_factory.mktemp("policy_model_fit") / "run"
    cli = UmaCLI(
        ["fit", "--config", RECIPE, *QUICK, "--trainer.default_root_dir", str(run_dir),
         "--trainer.logger.init_args.tracking_uri", mlflow_server,
         "--trainer.logger.init_args.experiment_name", "policy-model",
         "--trainer.logger.init_args.register_model", FIT_NAME]
    )  # fmt: skip
    return cli.trainer.logger.run_id, run_dir / "checkpoints"


def predicted_by(model_uri: str, observation: dict) -> np.ndarray:
    return mlflow.pyfunc.load_model(model_uri).predict(observation)


@pytest.mark.slow(seconds=50)  # a server, a training run, three model loads
def test_fit_registers_a_policy_model_that_acts_as_policy_does(mlflow_server, registered_fit, tmp_path):
    run_id, checkpoints = registered_fit
    client = MlflowClient(mlflow_server)
    mlflow.set_tracking_uri(mlflow_server)
    policy = Policy.from_checkpoint(checkpoints)
    observation = observations(policy, batch=3, seed=0)
    expected = policy(observation).numpy()
    for uri in (f"models:/{FIT_NAME}/1", f"runs:/{run_id}/model"):
        assert np.array_equal(predicted_by(uri, observation), expected), uri

    # The version carries the stage's headline metrics, and so does the logged model.
    run = client.get_run(run_id)
    final = {key: value for key, value in run.data.metrics.items() if key.startswith("final/")}
    assert set(final) == {"final/val_loss", "final/val_token_accuracy"}
    model_version = client.get_model_version(FIT_NAME, "1")
    assert model_version.run_id == run_id
    assert {key: float(model_version.tags[key]) for key in final} == final
    assert model_version.tags["checkpoint"] == str(checkpoints / "step-000000004")
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert logged.source_run_id == run_id and {m.key: m.value for m in logged.metrics} == final
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml", "provenance"]  # the model is apart

    # Signature, example, pinned requirements, and the weights themselves as an artifact.
    info = mlflow.models.get_model_info(f"models:/{FIT_NAME}/1")
    spec = policy.spec
    inputs = {tensor.name: (tensor.type, tensor.shape) for tensor in info.signature.inputs.inputs}
    assert inputs == {
        "images": (np.dtype(np.uint8), (-1, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3)),
        "state": (np.dtype(np.float32), (-1, spec.n_obs_steps, spec.state_dim)),
        "instruction": (np.dtype(str), (-1,)),
    }
    (output,) = info.signature.outputs.inputs
    assert output.shape == (-1, spec.action_horizon, spec.action_dim) and output.type == np.dtype(np.float32)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{FIT_NAME}/1", dst_path=str(tmp_path)))
    requirements = (local / "requirements.txt").read_text().split()
    for package in ("uma-lightning", "torch", "lightning", "mlflow"):
        assert f"{package}=={version(package)}" in requirements
    example = json.loads((local / "serving_input_example.json").read_text())["inputs"]
    assert np.asarray(example["images"]).shape == (1, *inputs["images"][1][1:])
    (weights_file,) = local.rglob("policy.safetensors")
    saved, source = load_file(weights_file), read_checkpoint(checkpoints)
    assert saved.keys() == source.weights.keys()
    assert all(saved[key].equal(source.weights[key]) for key in saved)

    # Exported again from its checkpoint, the policy goes into the run that saved it, not a new one.
    assert ckpt(["export", str(checkpoints), "--format", "mlflow", "--tracking-uri", mlflow_server]) == 0
    models = client.search_logged_models([run.info.experiment_id])
    assert len(models) == 2 and {m.source_run_id for m in models} == {run_id}
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slow(seconds=60)  # the session's pretrain run, a server, `mlflow models predict` in a new process
def test_an_exported_checkpoint_is_predicted_by_the_mlflow_cli_as_policy_does(
    mlflow_server, pretrained, tmp_path, capsys
):
    # A copy of the checkpoint, referenced rather than copied into the store, then moved away.
    checkpoint = tmp_path / "step"
    shutil.copytree(read_checkpoint(pretrained.checkpoints).path, checkpoint)
    assert ckpt(
        ["export", str(checkpoint), "--format", "mlflow", "--tracking-uri", mlflow_server,
         "--register", EXPORT_NAME, "--weights", "reference", "--experiment", "exports"]
    ) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"registered as models:/{EXPORT_NAME}/1" in out
    policy = Policy.from_checkpoint(checkpoint)
    observation = observations(policy, batch=2, seed=1)
    (tmp_path / "input.json").write_text(
        json.dumps({"inputs": {name: value.tolist() for name, value in observation.items()}})
    )
    mlflow_cli = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    subprocess.run(
        [mlflow_cli, "models", "predict", "-m", f"models:/{EXPORT_NAME}/1", "--env-manager", "local",
         "-i", str(tmp_path / "input.json"), "-t", "json", "-o", str(tmp_path / "output.json")],
        check=True, env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server}, capture_output=True,
    )  # fmt: skip
    predicted = np.asarray(json.loads((tmp_path / "output.json").read_text())["predictions"], dtype=np.float32)
    expected = policy(observation).numpy()
    assert np.array_equal(predicted, expected)

    # The recipe's own run, with the default settings, logged the same policy into its embedded store.
    store = MlflowClient(pretrained.store)
    (run,) = store.search_runs([store.get_experiment_by_name("pretrain").experiment_id])
    mlflow.set_tracking_uri(pretrained.store)
    assert np.array_equal(predicted_by(f"runs:/{run.info.run_id}/model", observation), expected)

    # The reference breaks when the checkpoint moves, naming where it looked.
    checkpoint.rename(tmp_path / "moved")
    mlflow.set_tracking_uri(mlflow_server)
    with pytest.raises(FileNotFoundError, match=f"checkpoint not found: {checkpoint}"):
        mlflow.pyfunc.load_model(f"models:/{EXPORT_NAME}/1")


@pytest.mark.slow(seconds=40)  # `mlflow models serve` in a new process
def test_a_registered_policy_is_served_over_http(mlflow_server, registered_fit, tmp_path):
    _, checkpoints = registered_fit
    result = serve_and_compare(f"models:/{FIT_NAME}/1", mlflow_server, checkpoints, tmp_path / "serve.log", requests=2)
    assert result["max_abs_diff"] == 0.0 and result["requests"] == 2


def test_export_refuses_a_missing_checkpoint_and_a_missing_output_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code = ckpt(["export", str(missing), "--format", "mlflow", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"uma ckpt: error: checkpoint not found: {missing}\n"
    code, _, err = run_main(["ckpt", "export", str(missing)], capsys)
    assert code == 2 and "export --format safetensors needs --to FILE" in err and "Traceback" not in err
