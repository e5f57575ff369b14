"""What the planner knows of a model: every parameter's shape and where each strategy puts it,
read from the model itself (built on the meta device, which costs no memory), and its FLOPs.

A robot model (``RobotBase`` with its registered plan) is known down to its blocks' shapes, so its
activations are written per block (``memory.py``). Any other network is known as the data-parallel
strategies see it: its units as the generic plan finds them (``parallel/plans/generic.py``), and what
autograd saves over one traced step of its stage's loss at two batch sizes (saved activations grow
linearly with the batch), on fake tensors, or on real ones for a step that depends on values."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from uma_lightning.cli_errors import ConfigError
from uma_lightning.models.robot import RobotModelConfig
from uma_lightning.parallel.plans.generic import data_parallel_units
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


@dataclass(frozen=True)
class TracedActivations:
    """Bytes autograd saved over one traced training step, per sample and whatever the batch."""

    per_sample: int
    fixed: int
    element_bytes: int  # of the traced network's floating dtype

    def at(self, batch: int, element_bytes: int) -> int:
        """The bytes saved for ``batch`` samples computed in elements of ``element_bytes``."""
        return (self.per_sample * batch + self.fixed) * element_bytes // self.element_bytes


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: caches key on it, and it holds a model
class ModelFacts:
    params: tuple[Param, ...]
    cfg: RobotModelConfig | None  # None: a network outside the robot family, sized from a traced step
    n_units: int
    flops_per_sample: int  # training (forward + backward), active experts only
    block_forward_flops_per_sample: int  # what full activation checkpointing recomputes
    tokens_per_sample: int
    model: nn.Module = field(compare=False, repr=False)  # on the meta device, for its parallel plan's own checks
    traced: TracedActivations | None = None  # what a network outside the robot family saves, traced

    @property
    def n_layers(self) -> int:
        return self.cfg.backbone.n_layers if self.cfg else 0

    @property
    def n_experts(self) -> int:
        moe = self.cfg.backbone.moe if self.cfg else None
        return moe.n_experts if moe and any(p.expert for p in self.params) else 0


def facts_of(
    model: nn.Module,
    cfg: RobotModelConfig | None,
    flops_per_sample: int,
    block_forward_flops: int,
    tokens_per_sample: int,
    traced: TracedActivations | None = None,
) -> ModelFacts:
    """The facts of a built model (any device, meta included); without ``cfg``, its units are those the
    generic plan wraps and nothing is split by tensor parallelism."""
    blocks = robot_blocks(model) if cfg else data_parallel_units(model)[0]
    unit_of = {id(module): index for index, block in enumerate(blocks) for module in block.modules()}
    module_of = {
        f"{name}.{pname}" if name else pname: module
        for name, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    colwise = BLOCK_COLWISE + tuple(name for head in heads_for(model) for name in head.tp_colwise) if cfg else ()
    rowwise = BLOCK_ROWWISE if cfg else ()
    layer_pattern = re.compile(r"^backbone\.layers\.(\d+)\.")
    params = []
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        tp_dim = 0 if colwise and owner.endswith(colwise) else 1 if rowwise and owner.endswith(rowwise) else None
        if not cfg:
            layer = -1  # no backbone: a network outside the robot family is not split into stages
        elif match := layer_pattern.match(name):
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
    return ModelFacts(
        tuple(params), cfg, len(blocks), flops_per_sample, block_forward_flops, tokens_per_sample, model, traced
    )


def _block_forward_flops(cfg: RobotModelConfig) -> int:
    from uma_lightning.models.flops import forward_flops_per_sample

    forward = forward_flops_per_sample(cfg)
    return forward["backbone_linear"] + forward["attention"]


def facts_of_stage(stage_module) -> ModelFacts:
    """The facts of a training stage's network (``StageModule``), built on the meta device; its
    training FLOPs counted over one step on fake tensors, on a batch of the data's shapes, and for a
    network outside the robot family its saved activations traced over the same step."""
    from uma_lightning.data.spec import example_batch
    from uma_lightning.models import RobotBase
    from uma_lightning.parallel.plans.registry import plan_for

    with torch.device("meta"):
        model = stage_module.build_model()
    flops = stage_module.count_flops_per_sample(example_batch(stage_module.spec, EXAMPLE_BATCH_SIZE))
    if flops is None:
        raise ConfigError(
            f"model: uma plan needs the training FLOPs of {type(model).__name__}, and its step cannot be counted "
            f"on fake tensors ({stage_module.flops_problem})"
        )
    tokens = getattr(model, "tokens_per_sample", None) or 1  # without the piece, a token is a sample
    if isinstance(model, RobotBase) and plan_for(model) is not None:
        return facts_of(model, model.cfg, flops, _block_forward_flops(model.cfg), tokens)
    return facts_of(model, None, flops, 0, tokens, traced_activations(stage_module))


def traced_activations(stage_module) -> TracedActivations:
    """What autograd saves over one forward of the stage's loss at two batch sizes, traced on fake
    tensors, or on real ones for a step that depends on values (as its FLOPs are counted)."""
    from uma_lightning.data.spec import example_batch

    sizes = (EXAMPLE_BATCH_SIZE, 2 * EXAMPLE_BATCH_SIZE)
    try:
        try:
            saved = [_saved_in_step(stage_module, example_batch(stage_module.spec, size), fake=True) for size in sizes]
        except Exception:  # noqa: BLE001  (whatever a value-dependent step raises on fake tensors)
            saved = [_saved_in_step(stage_module, example_batch(stage_module.spec, size), fake=False) for size in sizes]
    except Exception as err:  # noqa: BLE001  (whatever the network raises: said in one line)
        raise ConfigError(
            f"model: uma plan sizes the activations of {type(stage_module).__name__}'s network over one training "
            f"step, and the step fails ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    per_sample = (saved[1][0] - saved[0][0]) // (sizes[1] - sizes[0])
    return TracedActivations(per_sample, max(0, saved[0][0] - per_sample * sizes[0]), saved[0][1])


def _saved_in_step(stage_module, batch: dict, fake: bool) -> tuple[int, int]:
    """(Bytes autograd saves over the forward of the stage's loss on ``batch``, its loss's element size)."""
    from uma_lightning.modules.flops import step_on_rebuilt_network

    out: dict = {}
    with step_on_rebuilt_network(stage_module, batch, fake) as mode, mode:
        with saved_activation_bytes(stage_module.model, out):
            loss = stage_module.compute_loss(batch)["loss"]
    return out["bytes"], loss.element_size()


@contextmanager
def saved_activation_bytes(model: nn.Module, out: dict):
    """Sums into ``out["bytes"]`` the storages autograd saves inside the block, each once, without the
    model's weights (real, sharded or fake tensors alike)."""
    seen: set[int] = set()
    out["bytes"] = 0

    def pack(tensor: torch.Tensor):
        storage = local_tensor(tensor).untyped_storage()
        weights = {local_tensor(p).untyped_storage()._cdata for p in model.parameters()}
        if isinstance(tensor, nn.Parameter) or storage._cdata in weights or storage._cdata in seen:
            return tensor
        seen.add(storage._cdata)
        out["bytes"] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def facts_of_config(cfg: RobotModelConfig) -> ModelFacts:
    """The facts of the pretraining network (``RobotTransformer``) of ``cfg``, built on the meta device."""
    from uma_lightning.models import RobotTransformer
    from uma_lightning.models.flops import training_flops_per_sample

    with torch.device("meta"):
        model = RobotTransformer(cfg)
    return facts_of(model, cfg, training_flops_per_sample(cfg), _block_forward_flops(cfg), cfg.seq_len)
