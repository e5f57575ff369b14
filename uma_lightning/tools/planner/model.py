"""What the planner knows of a model: every parameter's shape and where each strategy puts it,
read from the model itself (built on the meta device, which costs no memory), and its FLOPs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from uma_lightning.cli_errors import ConfigError
from uma_lightning.models.robot import RobotModelConfig
from uma_lightning.parallel.plans.registry import heads_for
from uma_lightning.parallel.plans.robot import BLOCK_COLWISE, BLOCK_ROWWISE, robot_blocks

# Parameters outside the blocks that the forward uses after the backbone: a pipeline's last stage holds them.
AFTER_BACKBONE = ("backbone.norm.", "action_head.", "environment_state_head.")
EXPERT_WEIGHTS = re.compile(r"\.experts\.w[123]$")
# Samples of the batch a step's FLOPs are counted on: more than one, so a network that squeezes its
# batch dimension runs as in training.
EXAMPLE_BATCH_SIZE = 2


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    unit: int  # the FSDP unit: index into the model's blocks, or -1 for the root
    layer: int  # backbone layer, -1 before the backbone (tokenizers, embeddings), n_layers after it
    tp_dim: int | None  # the dim tensor parallelism splits, None where it replicates
    expert: bool  # a stacked [E, ...] expert weight, split over ep on dim 0
    trainable: bool


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: caches key on it, and it holds a model
class ModelFacts:
    params: tuple[Param, ...]
    cfg: RobotModelConfig
    n_units: int
    flops_per_sample: int  # training (forward + backward), active experts only
    block_forward_flops_per_sample: int  # what full activation checkpointing recomputes
    tokens_per_sample: int
    model: nn.Module = field(compare=False, repr=False)  # on the meta device, for its parallel plan's own checks

    @property
    def n_layers(self) -> int:
        return self.cfg.backbone.n_layers

    @property
    def n_experts(self) -> int:
        moe = self.cfg.backbone.moe
        return moe.n_experts if moe and any(p.expert for p in self.params) else 0


def facts_of(
    model: nn.Module, cfg: RobotModelConfig, flops_per_sample: int, block_forward_flops: int, tokens_per_sample: int
) -> ModelFacts:
    """The facts of a built model (any device, meta included)."""
    blocks = robot_blocks(model)
    unit_of = {id(module): index for index, block in enumerate(blocks) for module in block.modules()}
    module_of = {
        f"{name}.{pname}" if name else pname: module
        for name, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    colwise = BLOCK_COLWISE + tuple(name for head in heads_for(model) for name in head.tp_colwise)
    layer_pattern = re.compile(r"^backbone\.layers\.(\d+)\.")
    params = []
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        tp_dim = 0 if owner.endswith(colwise) else 1 if owner.endswith(BLOCK_ROWWISE) else None
        if match := layer_pattern.match(name):
            layer = int(match.group(1))
        else:
            layer = (
                cfg.backbone.n_layers
                if name.startswith(AFTER_BACKBONE) or unit_of.get(id(module_of[name]), -1) >= 0
                else -1
            )
        expert = bool(EXPERT_WEIGHTS.search(name))
        params.append(
            Param(
                name,
                tuple(param.shape),
                unit_of.get(id(module_of[name]), -1),
                layer,
                tp_dim,
                expert,
                param.requires_grad,
            )
        )
    return ModelFacts(tuple(params), cfg, len(blocks), flops_per_sample, block_forward_flops, tokens_per_sample, model)


def _block_forward_flops(cfg: RobotModelConfig) -> int:
    from uma_lightning.models.flops import forward_flops_per_sample

    forward = forward_flops_per_sample(cfg)
    return forward["backbone_linear"] + forward["attention"]


def facts_of_stage(stage_module) -> ModelFacts:
    """The facts of a training stage's network (``StageModule``), built on the meta device; its
    training FLOPs counted over one step on fake tensors, on a batch of the data's shapes."""
    from uma_lightning.data.spec import example_batch
    from uma_lightning.models import RobotBase
    from uma_lightning.parallel.plans.registry import plan_for

    with torch.device("meta"):
        model = stage_module.build_model()
    if not isinstance(model, RobotBase) or plan_for(model) is None:
        # The memory and FLOP figures come from the robot family's configuration and plan.
        raise ConfigError(
            f"{type(model).__name__} (built by {type(stage_module).__name__}) is not a robot model (RobotBase): "
            "uma plan sizes that family only so far; measure another network with a short uma fit run"
        )
    cfg = model.cfg
    flops = stage_module.count_flops_per_sample(example_batch(stage_module.spec, EXAMPLE_BATCH_SIZE))
    if flops is None:
        raise ConfigError(
            f"model: uma plan needs the training FLOPs of {type(model).__name__}, and its step cannot be counted "
            f"on fake tensors ({stage_module.flops_problem})"
        )
    tokens = getattr(model, "tokens_per_sample", None) or 1  # without the piece, a token is a sample
    return facts_of(model, cfg, flops, _block_forward_flops(cfg), tokens)


def facts_of_config(cfg: RobotModelConfig) -> ModelFacts:
    """The facts of the pretraining network (``RobotTransformer``) of ``cfg``, built on the meta device."""
    from uma_lightning.models import RobotTransformer
    from uma_lightning.models.flops import training_flops_per_sample

    with torch.device("meta"):
        model = RobotTransformer(cfg)
    return facts_of(model, cfg, training_flops_per_sample(cfg), _block_forward_flops(cfg), cfg.seq_len)
