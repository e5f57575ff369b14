"""LightningModules, one per training stage; research code subclasses these."""

from uma_lightning.modules.pretrain import OptimizerConfig, PretrainModule

__all__ = ["OptimizerConfig", "PretrainModule"]
