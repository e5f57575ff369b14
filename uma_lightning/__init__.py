"""uma-lightning: production training for humanoid-robot foundation models on PyTorch Lightning."""

from uma_lightning._lazy import lazy_exports

__version__ = "0.1.0"

# Imported on first use, so `import uma_lightning.models` stays free of Lightning and MLflow.
_EXPORTS = {
    "PretrainModule": "uma_lightning.modules",
    "MidtrainModule": "uma_lightning.modules",
    "PosttrainModule": "uma_lightning.modules",
    "Policy": "uma_lightning.policy",
    "OptimizerConfig": "uma_lightning.modules",
    "NetworkConfig": "uma_lightning.models.network",
    "RobotDataModule": "uma_lightning.data",
    "DataSpec": "uma_lightning.data",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
