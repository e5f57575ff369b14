"""A trained policy as an MLflow Model: ``mlflow.pyfunc.load_model``, ``mlflow models predict`` and
``mlflow models serve`` turn observations into action chunks in robot units, through ``Policy``.

The model, ``runs:/<run id>/model`` (and ``models:/NAME/VERSION`` once registered), takes a batch of
named tensors, as ``Policy`` does (``policy.py``):

- ``images``: uint8 ``[B, n_obs_steps, cameras, H, W, 3]``;
- ``state``: float32 ``[B, n_obs_steps, state_dim]``;
- ``instruction``: ``[B]`` strings;

and returns float32 ``[B, action_horizon, action_dim]``. Over HTTP: ``POST /invocations`` with
``{"inputs": {"images": [...], "state": [...], "instruction": [...]}}``. It runs on the GPU when
there is one; ``mlflow.pyfunc.load_model(uri, model_config={"device": "cpu"})`` chooses.

Where the weights live (``weights``):

- ``"artifact"`` (the default): the policy's weights alone (EMA when trained with it, no optimizer
  state), one safetensors file copied into the model's artifacts. The model then stands on its own:
  it survives the checkpoint's retention (``keep_last`` deletes older checkpoints as training goes
  on), a moved run directory and another machine. Its cost is a second copy of the weights, a third
  to a quarter of a checkpoint's size under Adam (whose moments and master weights stay behind).
- ``"reference"``: the model records the checkpoint's absolute path and reads it when loaded. Nothing
  is copied, which matters for models of many GB; but the model breaks when that checkpoint is
  deleted or moved, or is loaded where the path is not mounted. Use it for checkpoints on shared
  storage that is kept.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal, Optional

import mlflow
import numpy as np
import torch
from mlflow import MlflowClient
from mlflow.models import Model, ModelSignature
from mlflow.models.model import ModelInfo
from mlflow.types import Schema, TensorSpec

from uma_lightning.checkpoint.weights import CheckpointWeights, save_weights_file
from uma_lightning.models.network import grouped_settings, spec_of
from uma_lightning.policy import Policy

log = logging.getLogger(__name__)

MODEL_NAME = "model"  # runs:/<run id>/model
WEIGHTS_FILE = "policy.safetensors"
WeightsPlacement = Literal["artifact", "reference"]
# Pinned to the versions this process runs, so a served model gets the code it was logged with.
PINNED_PACKAGES = ("uma-lightning", "torch", "lightning", "mlflow", "numpy", "safetensors")
EXAMPLE_INSTRUCTION = "reach the target"
# MLflow's "models from code": the model is this code, run when it is loaded, rather than a pickled
# object (loading a pickle runs whatever it names). A file of its own, written when the model is
# logged: a module of the package that did this would register a model with MLflow on import.
MODEL_CODE = """from mlflow.models import set_model

from uma_lightning.tracking.policy_model import PolicyModel

set_model(PolicyModel())
"""


class PolicyModel(mlflow.pyfunc.PythonModel):
    """``Policy`` behind MLflow's pyfunc interface (see the module docstring)."""

    # MLflow's switch (its ChatModel sets it) against deriving a schema from ``predict``'s type hints,
    # and warning, when the class is made, that there are none: the signature is the schema.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        config = context.model_config or {}
        source = context.artifacts.get("weights") or config["checkpoint"]
        device = config.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.policy = Policy.from_checkpoint(source, device=device)

    def predict(self, context, model_input, params=None):
        """``model_input``: the observation tensors by name; returns the actions as a numpy array."""
        return self.policy(model_input).cpu().numpy()


def policy_signature(hparams: dict) -> ModelSignature:
    spec = spec_of(hparams)
    steps, cameras = spec.n_obs_steps, len(spec.cameras)
    inputs = Schema(
        [
            TensorSpec(np.dtype(np.uint8), (-1, steps, cameras, *spec.image_size, 3), "images"),
            TensorSpec(np.dtype(np.float32), (-1, steps, spec.state_dim), "state"),
            TensorSpec(np.dtype(str), (-1,), "instruction"),
        ]
    )
    outputs = Schema([TensorSpec(np.dtype(np.float32), (-1, spec.action_horizon, spec.action_dim), "actions")])
    return ModelSignature(inputs, outputs)


def example_observation(hparams: dict) -> dict[str, np.ndarray]:
    """One observation of the shapes the policy takes: grey frames, the state the normalisation is
    centred on, a short instruction."""
    spec = spec_of(hparams)
    steps = spec.n_obs_steps
    state = np.asarray(hparams["normalization"]["state"]["offset"], dtype=np.float32)
    return {
        "images": np.full((1, steps, len(spec.cameras), *spec.image_size, 3), 128, dtype=np.uint8),
        "state": np.broadcast_to(state, (1, steps, spec.state_dim)).copy(),
        "instruction": np.array([EXAMPLE_INSTRUCTION]),
    }


def pinned_requirements() -> list[str]:
    pins = []
    for package in PINNED_PACKAGES:
        try:
            pins.append(f"{package}=={version(package)}")
        except PackageNotFoundError:  # a source tree run without installing
            log.warning("%s is not installed as a package; the MLflow model does not pin it", package)
    return pins


def final_metrics(client: MlflowClient, run_id: str) -> tuple[dict[str, float], int]:
    """The run's headline ``final/`` metrics and the step they were logged at (0 without any)."""
    metrics = {key: value for key, value in client.get_run(run_id).data.metrics.items() if key.startswith("final/")}
    step = max((client.get_metric_history(run_id, key)[-1].step for key in metrics), default=0)
    return metrics, step


def log_policy_model(
    tracking_uri: str,
    run_id: str,
    source: CheckpointWeights,
    weights: WeightsPlacement = "artifact",
    register_as: Optional[str] = None,
) -> ModelInfo:
    """Log the policy of the checkpoint ``source`` (``read_checkpoint`` of any path ``Policy.from_checkpoint``
    reads) into run ``run_id`` as the MLflow Model ``model``; with ``register_as``, register it as a
    new version of that model, tagged with the run's ``final/`` metrics. The run's metrics at the
    step they were logged become the logged model's."""
    if weights not in ("artifact", "reference"):
        raise ValueError(f"weights must be 'artifact' or 'reference', got {weights!r}")
    hparams = grouped_settings(source.hparams)
    if not hparams.get("normalization"):
        raise ValueError(f"{source.path}: no normalization statistics in the checkpoint; it cannot act in robot units")
    client = MlflowClient(tracking_uri)
    metrics, step = final_metrics(client, run_id)
    run = client.get_run(run_id)
    # Made here rather than by Model.log, which would put it in the process's active experiment
    # (Default) instead of the run's, where ``runs:/<run id>/model`` looks for it.
    logged = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, params=run.data.params, model_type="policy"
    )
    with tempfile.TemporaryDirectory() as scratch:
        code = Path(scratch) / "policy_model_code.py"
        code.write_text(MODEL_CODE)
        if weights == "artifact":
            weights_file = Path(scratch) / WEIGHTS_FILE
            save_weights_file(
                weights_file,
                source.weights,
                source.hparams,
                {
                    "module_class": source.module_class,
                    "network_builder": source.network_builder,
                    "ema": str(source.ema).lower(),
                    "source": source.path,
                },
            )
            placement = {"artifacts": {"weights": str(weights_file)}}
        else:
            placement = {"artifacts": {}, "model_config": {"checkpoint": str(Path(source.path).resolve())}}
        with _tracking_uri(tracking_uri), _quiet_example_check():
            info = Model.log(
                artifact_path=None,
                name=MODEL_NAME,
                flavor=mlflow.pyfunc,
                run_id=run_id,
                python_model=str(code),
                signature=policy_signature(hparams),
                input_example=example_observation(hparams),
                pip_requirements=pinned_requirements(),
                metadata={"checkpoint": source.path, "ema": source.ema, "weights": weights},
                registered_model_name=register_as,
                step=step,
                model_id=logged.model_id,
                **placement,
            )
    if register_as:
        version_ = info.registered_model_version
        for key, value in {**metrics, "checkpoint": source.path}.items():
            client.set_model_version_tag(register_as, str(version_), key, str(value))
        log.info("registered the policy of %s as models:/%s/%s", source.path, register_as, version_)
    log.info("logged the policy of %s as runs:/%s/%s (weights: %s)", source.path, run_id, MODEL_NAME, weights)
    return info


@contextmanager
def _quiet_example_check():
    """MLflow checks the input example by downloading and loading the model it just logged: useful,
    but its download bar and the load's log lines would read as if the run were doing more work."""
    saved_env = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    loggers = [logging.getLogger(name) for name in ("mlflow", "uma_lightning")]
    levels = [logger.level for logger in loggers]
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if saved_env is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = saved_env


@contextmanager
def _tracking_uri(uri: str):
    """MLflow's model logging reads the process-wide tracking URI. Set for the call only, and
    $MLFLOW_TRACKING_URI, which MLflow also sets and then clears, left as it was."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    saved = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved
