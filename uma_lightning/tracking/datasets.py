"""The datasets a run trains on, as MLflow dataset inputs: the UI's Dataset column and its filters."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.entities import DatasetInput

# MLflow's tag for what a dataset was used for; the UI shows it beside the dataset's name.
CONTEXT_TAG = "mlflow.data.context"


def metadata_digest(meta) -> str:
    """12 hex digits of SHA-256 over the dataset's info.json, tasks, episode table and statistics:
    the same for the same data wherever it is stored, different when any of it changes."""
    content = {
        "info": meta.info,
        "tasks": list(meta.tasks),
        "episodes": [(e.index, e.length, e.data_file, sorted(e.videos.items())) for e in meta.episodes],
        "stats": {
            key: {name: value.tolist() for name, value in stat.items()} for key, stat in sorted(meta.stats.items())
        },
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:12]


def dataset_inputs(datamodule) -> list[DatasetInput]:
    """One input per dataset of a ``RobotDataModule``'s mixture, with its share of the draws and its
    train/validation split as input tags; empty for data modules without LeRobot metadata."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    sources, metadata, splits = (getattr(datamodule, name, None) for name in ("sources", "metadata", "splits"))
    if not (sources and metadata and splits):
        return []
    total = sum(source.weight for source in sources)
    inputs = []
    for source, meta, (train, val) in zip(sources, metadata, splits):
        root = str(meta.root)
        profile = {
            "format": f"LeRobot {meta.version}",
            "episodes": len(meta.episodes),
            "frames": sum(e.length for e in meta.episodes),
            "fps": meta.fps,
            "cameras": list(meta.cameras),
        }
        dataset = Dataset(
            name=Path(root.rstrip("/")).name,
            digest=metadata_digest(meta),
            source_type="local" if "://" not in root else root.split("://", 1)[0],
            source=json.dumps({"uri": root}),
            profile=json.dumps(profile),
        )
        tags = {
            CONTEXT_TAG: "train",
            "weight": f"{source.weight / total:.4g}",
            "train_episodes": str(len(train)),
            "val_episodes": str(len(val)),
        }
        inputs.append(DatasetInput(dataset, [InputTag(key, value) for key, value in tags.items()]))
    return inputs
