"""What the planner knows of a model: every parameter's shape and where each strategy puts it,
read from the model itself (built on the meta device, which costs no memory), and its FLOPs.

A robot model (``RobotBase`` with its registered plan) is known down to its blocks' shapes, so its
activations are written per block (``memory.py``). Any other network is known as the data-parallel
strategies see it: its units as the generic plan finds them (``parallel/plans/generic.py``), and what
autograd saves over one traced step of its stage's loss at two batch sizes (saved activations grow
linearly with the batch), on fake tensors, or on real ones for a step that depends on values."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from uma_lightning.cli_errors import ConfigError
from uma_lightning.models.robot import RobotModelConfig
from uma_lightning.parallel.plans.generic import data_parallel_units, tp_styles
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
    tp_exchange: tuple[int, int] = (0, 0)  # elements per sample all-reduced over tp (forward, backward)

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
    tokens_per_sample: int | None  # None: a network that declares no tokens, measured in samples
    model: nn.Module = field(compare=False, repr=False)  # on the meta device, for its parallel plan's own checks
    # A network outside the robot family: what a rank saves at a tp size, traced (``traced_activations``),
    # and the elements per sample its tp_plan all-reduces over tp (forward, backward).
    traced: Callable[[int], TracedActivations] | None = field(default=None, compare=False, repr=False)
    tp_exchange: tuple[int, int] = (0, 0)

    @property
    def throughput_unit(self) -> str:
        return "tokens" if self.tokens_per_sample else "samples"

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
    tokens_per_sample: int | None,
    traced: Callable[[int], TracedActivations] | None = None,
    tp_exchange: tuple[int, int] = (0, 0),
) -> ModelFacts:
    """The facts of a built model (any device, meta included); without ``cfg``, its units are those the
    generic plan wraps and its tp_plan splits its linear layers."""
    blocks = robot_blocks(model) if cfg else data_parallel_units(model)[0]
    unit_of = {id(module): index for index, block in enumerate(blocks) for module in block.modules()}
    module_of = {
        f"{name}.{pname}" if name else pname: module
        for name, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    colwise = BLOCK_COLWISE + tuple(name for head in heads_for(model) for name in head.tp_colwise) if cfg else ()
    rowwise = BLOCK_ROWWISE if cfg else ()
    styles = {} if cfg else tp_styles(model)
    layer_pattern = re.compile(r"^backbone\.layers\.(\d+)\.")
    params = []
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        tp_dim = 0 if colwise and owner.endswith(colwise) else 1 if rowwise and owner.endswith(rowwise) else None
        if owner in styles:  # column-wise: weight and bias split on the outputs; row-wise: the weight's inputs
            tp_dim = 0 if styles[owner] == "colwise" else 1 if name.endswith("weight") else None
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
        tuple(params),
        cfg,
        len(blocks),
        flops_per_sample,
        block_forward_flops,
        tokens_per_sample,
        model,
        traced,
        tp_exchange,
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
    tokens = getattr(model, "tokens_per_sample", None)
    if isinstance(model, RobotBase) and plan_for(model) is not None:
        return facts_of(model, model.cfg, flops, _block_forward_flops(model.cfg), tokens)
    traced = functools.cache(lambda tp: traced_activations(stage_module, tp))
    return facts_of(model, None, flops, 0, tokens, traced, traced(1).tp_exchange)


def traced_activations(stage_module, tp: int = 1) -> TracedActivations:
    """What autograd saves over one forward of the stage's loss on a rank of ``tp`` (its tp_plan's
    layers cut to that rank's share), at two batch sizes, traced on fake tensors, or on real ones for
    a step that depends on values (as its FLOPs are counted)."""
    from uma_lightning.data.spec import example_batch

    sizes = (EXAMPLE_BATCH_SIZE, 2 * EXAMPLE_BATCH_SIZE)
    try:
        try:
            saved = [_saved_in_step(stage_module, example_batch(stage_module.spec, size), True, tp) for size in sizes]
        except Exception:  # noqa: BLE001  (whatever a value-dependent step raises on fake tensors)
            saved = [_saved_in_step(stage_module, example_batch(stage_module.spec, size), False, tp) for size in sizes]
    except Exception as err:  # noqa: BLE001  (whatever the network raises: said in one line)
        raise ConfigError(
            f"model: uma plan sizes the activations of {type(stage_module).__name__}'s network over one training "
            f"step, and the step fails ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    (small, element_bytes, _), (large, _, exchanged) = saved
    per_sample = (large - small) // (sizes[1] - sizes[0])
    exchange = (exchanged[0] // sizes[1], exchanged[1] // sizes[1])
    return TracedActivations(per_sample, max(0, small - per_sample * sizes[0]), element_bytes, exchange)


def _saved_in_step(stage_module, batch: dict, fake: bool, tp: int) -> tuple[int, int, tuple[int, int]]:
    """(Bytes autograd saves over the forward of the stage's loss on ``batch`` on a rank of ``tp``, its
    loss's element size, the elements tensor parallelism all-reduces: row-wise layers' outputs in
    the forward, column-wise layers' inputs that need a gradient in the backward)."""
    from uma_lightning.modules.flops import step_on_rebuilt_network

    out: dict = {}
    exchanged = [0, 0]

    def count(style: str, inputs, output) -> None:
        if style == "rowwise":
            exchanged[0] += output.numel()
        elif inputs[0].requires_grad:
            exchanged[1] += inputs[0].numel()

    with step_on_rebuilt_network(stage_module, batch, fake) as mode, mode:
        network = stage_module.model
        hooks = []
        for name, style in tp_styles(network).items():
            linear = network.get_submodule(name)
            hooks.append(
                linear.register_forward_hook(lambda _, inputs, output, style=style: count(style, inputs, output))
            )
            _cut_to_rank(linear, style, tp)
        with saved_activation_bytes(network, out):
            loss = stage_module.compute_loss(batch)["loss"]
        for hook in hooks:
            hook.remove()
    return out["bytes"], loss.element_size(), (exchanged[0], exchanged[1])


def _cut_to_rank(linear: nn.Linear, style: str, tp: int) -> None:
    """Keep the first rank's share of a tensor-parallel linear layer, as ColwiseParallel and RowwiseParallel do."""
    if tp == 1:
        return
    if style == "colwise":
        linear.weight = nn.Parameter(linear.weight[: linear.out_features // tp])
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[: linear.out_features // tp])
    else:
        linear.weight = nn.Parameter(linear.weight[:, : linear.in_features // tp])


@contextmanager
def saved_activation_bytes(model: nn.Module, out: dict):
    """Sums into ``out["bytes"]`` the storages autograd saves inside the block, each once, without the
    model's weights (real, sharded or fake tensors alike)."""
    seen: set[int] = set()
    out["bytes"] = 0
    # The parameters as they are at each saved tensor: FSDP swaps its unsharded ones in during the forward.
    # Walking the module tree at every saved tensor took 38 of the 57 s that SmolVLM-256M's plan took, so
    # the storages are listed again only when a parameter object changed.
    holders = [(module._parameters, name) for module in model.modules() for name in module._parameters]
    listed: dict = {"parameters": None, "storages": set()}

    def weight_storages() -> set[int]:
        now = [parameters[name] for parameters, name in holders]
        before = listed["parameters"]
        if before is None or any(a is not b for a, b in zip(now, before)):
            storages = {local_tensor(p).untyped_storage()._cdata for p in now if p is not None}
            listed.update(parameters=now, storages=storages)
        return listed["storages"]

    def pack(tensor: torch.Tensor):
        storage = local_tensor(tensor).untyped_storage()
        if isinstance(tensor, nn.Parameter) or storage._cdata in weight_storages() or storage._cdata in seen:
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
