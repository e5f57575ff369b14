"""LightningModules, one per training stage, sharing ``StageModule``; research code subclasses these."""

from uma_lightning.models.lora import LoraConfig
from uma_lightning.models.network import NetworkConfig
from uma_lightning.modules.base import OptimizerConfig, StageModule
from uma_lightning.modules.midtrain import MidtrainModule
from uma_lightning.modules.posttrain import PosttrainModule
from uma_lightning.modules.pretrain import PretrainModule

__all__ = [
    "LoraConfig",
    "MidtrainModule",
    "NetworkConfig",
    "OptimizerConfig",
    "PosttrainModule",
    "PretrainModule",
    "StageModule",
]
