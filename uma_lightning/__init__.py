"""uma-lightning: production training for humanoid-robot foundation models on PyTorch Lightning."""

from importlib import import_module

__version__ = "0.1.0"

# Imported on first use, so `import uma_lightning.models` stays free of Lightning and MLflow.
_EXPORTS = {
    "PretrainModule": "uma_lightning.modules",
    "OptimizerConfig": "uma_lightning.modules",
    "RobotDataModule": "uma_lightning.data",
    "DataSpec": "uma_lightning.data",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'uma_lightning' has no attribute {name!r}")


__all__ = list(_EXPORTS)
