"""Pure PyTorch models: no Lightning, no distributed code."""

from uma_lightning.models.flops import (
    count_active_parameters,
    count_parameters,
    flow_training_flops_per_sample,
    training_flops_per_sample,
    training_flops_per_token,
)
from uma_lightning.models.flow import ActionExpertConfig, RobotFlowTransformer
from uma_lightning.models.flow_matching import FlowMatchingConfig
from uma_lightning.models.moe import MoEConfig, MoEFeedForward, moe_layers
from uma_lightning.models.robot import RobotBase, RobotModelConfig, RobotTransformer
from uma_lightning.models.sizes import load_size, preset_names
from uma_lightning.models.tokenizers import VisionConfig
from uma_lightning.models.transformer import Transformer, TransformerConfig

__all__ = [
    "ActionExpertConfig",
    "FlowMatchingConfig",
    "MoEConfig",
    "MoEFeedForward",
    "RobotBase",
    "RobotFlowTransformer",
    "RobotModelConfig",
    "RobotTransformer",
    "Transformer",
    "TransformerConfig",
    "VisionConfig",
    "count_active_parameters",
    "count_parameters",
    "flow_training_flops_per_sample",
    "load_size",
    "moe_layers",
    "preset_names",
    "training_flops_per_sample",
    "training_flops_per_token",
]
