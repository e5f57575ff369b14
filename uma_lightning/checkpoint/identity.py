"""What a run is, so that a run resumes only checkpoints of the same run.

Every checkpoint's manifest records its run's identity (``run_identity``): the LightningModule's class,
its hyperparameters (the network and its size, the data shapes, a research subclass's own arguments)
and the data it trains on (each dataset's metadata digest, its weight in the mixture and its train
split). A run started in a folder that holds checkpoints of another identity would otherwise load
them, fail on a shape mismatch halfway and reopen the other run's MLflow run on the way.

Some settings may change between a run and its resumption: how it is optimised (a new learning
rate after a restart), where it first started from, how ops are implemented (kernels), and where its
data is stored (a dataset moved to another disk or bucket keeps its digest).
"""

from __future__ import annotations

import json
from typing import Any

MAY_CHANGE_ON_RESUME = ("optimizer", "init_from", "normalization", "network/kernels")
LISTED = 3  # differences named in the error, of however many there are


def run_identity(module, datamodule=None) -> dict[str, Any]:
    """The identity of a run of ``module`` on ``datamodule``, as JSON-able values."""
    from uma_lightning.tracking.mlflow_logger import flatten_params

    cls = type(module)
    hyperparameters = {
        key: value
        for key, value in flatten_params(dict(getattr(module, "hparams", {}))).items()
        if not any(key == prefix or key.startswith(prefix + "/") for prefix in MAY_CHANGE_ON_RESUME)
    }
    return {
        "model": f"{cls.__module__}.{cls.__qualname__}",
        "hyperparameters": hyperparameters,
        "data": data_identity(datamodule),
    }


def data_identity(datamodule) -> list[dict]:
    """Each dataset of a ``RobotDataModule``'s mixture: root, metadata digest, weight and train episodes;
    empty for data modules without LeRobot metadata."""
    from uma_lightning.tracking.datasets import metadata_digest

    sources, metadata, splits = (getattr(datamodule, name, None) for name in ("sources", "metadata", "splits"))
    if not (sources and metadata and splits):
        return []
    return [
        {"root": str(meta.root), "digest": metadata_digest(meta), "weight": source.weight, "train_episodes": len(train)}
        for source, meta, (train, _val) in zip(sources, metadata, splits)
    ]


def identity_differences(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's identity (``saved``) and this run's, one phrase each, as
    ``<what> <this run's> (checkpoint: <the checkpoint's>)``. Settings only one of them records (a
    setting added by a newer version) are not compared."""
    found = []
    if saved.get("model") != current["model"]:
        found.append(f"model class_path {current['model']} (checkpoint: {saved.get('model')})")
    ours, theirs = current["hyperparameters"], saved.get("hyperparameters", {})
    for key in sorted(set(ours) & set(theirs)):
        if ours[key] != theirs[key]:
            found.append(f"model.{key.replace('/', '.')} {ours[key]} (checkpoint: {theirs[key]})")
    if "data" in saved and _comparable(saved["data"]) != _comparable(current["data"]):
        found.append(f"data {_describe(current['data'])} (checkpoint: {_describe(saved['data'])})")
    return found


def _comparable(data: list[dict]) -> str:
    """The data without where it is stored."""
    return json.dumps([{key: value for key, value in entry.items() if key != "root"} for entry in data], sort_keys=True)


def _describe(data: list[dict]) -> str:
    return " + ".join(
        f"{entry['root']} [digest {entry['digest']}, {entry['train_episodes']} train episodes]" for entry in data
    )
