"""Pure PyTorch models: no Lightning, no distributed code."""

from uma_lightning.models.flops import count_parameters, training_flops_per_sample, training_flops_per_token
from uma_lightning.models.robot import RobotModelConfig, RobotTransformer
from uma_lightning.models.sizes import load_size, preset_names
from uma_lightning.models.transformer import Transformer, TransformerConfig

__all__ = [
    "RobotModelConfig",
    "RobotTransformer",
    "Transformer",
    "TransformerConfig",
    "count_parameters",
    "load_size",
    "preset_names",
    "training_flops_per_sample",
    "training_flops_per_token",
]
