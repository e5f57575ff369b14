"""Pipeline plan of the robot transformer (``RobotTransformer``): which layers each stage holds, and the stages.

The model is cut into contiguous stages along its units: the tokenizers and embeddings (always
on the first stage), the backbone's layers, and the final norm with the action head and its loss
(always on the last). The default cut balances the stages' training FLOPs, from the model's own
FLOP formulas (``models/flops.py``): the tokenizers count as a unit, because a vision tower can be
as heavy as several layers. ``pipeline.split`` names the layers where stages start instead.

Each rank keeps the model object and drops what its stages do not hold: those layers, embeddings
and heads are set to None in place. Parameter names thus stay the unwrapped model's
(``backbone.layers.7.attn.wq.weight`` on whichever rank holds layer 7), so a checkpoint saved with
one split loads with any other, under any strategy, or into one process.

A ``RobotStage`` runs its part of the forward, from the model's own steps (``embed_sequence``,
its blocks, ``action_states``, ``action_loss_of``); it holds the modules it runs (so the schedule
scales and reduces exactly their gradients) but not the model, whose parameter names it would
otherwise prefix. Between stages travel only the hidden states [microbatch, seq_len, dim]; the
text mask, from which each stage rebuilds the attention mask, is given to every stage with the batch.

Each stage is laid out by the robot plan's ``lay_out``, as the whole model is (TP -> AC -> compile
-> data parallel), but around the stage modules, since the schedule calls those, never the model:
data parallelism (FSDP, DDP) wraps each stage module as its root and each of its blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from uma_lightning.models import RobotFlowTransformer, RobotTransformer
from uma_lightning.models.flops import training_flops_per_unit
from uma_lightning.models.moe import MoEFeedForward, combined_stats, moe_layers
from uma_lightning.parallel.apply import ParallelConfig
from uma_lightning.parallel.mesh import MeshShape
from uma_lightning.parallel.pipeline import ZERO_BUBBLE, Pipeline, PipelineConfig
from uma_lightning.parallel.plans.robot import (
    action_embedding_layout,
    action_head_layout,
    apply_sequence_parallel_blocks,
    apply_tp_tokenizers,
    lay_out,
)

log = logging.getLogger("uma_lightning")

# What the first stage embeds with and the last predicts with, besides the backbone's layers.
FIRST_STAGE_MODULES = (
    "text_embed",
    "image_tokenizer",
    "instruction_pooling",
    "camera_embed",
    "state_proj",
    "action_embed",
    "action_dim_embed",
)
LAST_STAGE_MODULES = ("backbone.norm", "action_head")


@dataclass(frozen=True)
class StageSplit:
    """Backbone layers [starts[s], starts[s + 1]) on stage s, and each stage's share of the training FLOPs."""

    starts: tuple[int, ...]
    n_layers: int
    shares: tuple[float, ...]

    def layers(self, stage: int) -> range:
        ends = self.starts[1:] + (self.n_layers,)
        return range(self.starts[stage], ends[stage])

    def describe(self) -> str:
        parts = []
        for stage, share in enumerate(self.shares):
            layers = self.layers(stage)
            what = [f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"]
            if stage == 0:
                what.insert(0, "tokenizers")
            if stage == len(self.shares) - 1:
                what.append("heads")
            parts.append(f"stage {stage}: {' + '.join(what)} ({100 * share:.0f}%{' of FLOPs' if stage == 0 else ''})")
        return ", ".join(parts)


def unit_flops(model: RobotTransformer) -> list[int]:
    """Training FLOPs per sample of [tokenizers, layer 0, ..., layer n-1, heads]."""
    tokenizers, layers, heads = training_flops_per_unit(model.cfg)
    return [tokenizers, *layers, heads]


def balanced_starts(costs: list[int], n_stages: int) -> tuple[int, ...]:
    """Where each stage's layers start so that the most expensive stage is as cheap as can be.

    ``costs`` are [tokenizers, layers..., heads]; every stage holds at least one layer. Exact, by
    dynamic programming over (stages, layers): a few thousand sums for any real model.
    """
    n_layers = len(costs) - 2
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def span(first: int, end: int, stage: int) -> int:  # cost of layers [first, end) on ``stage``
        return (
            prefix[end + 1]
            - prefix[first + 1]
            + (costs[0] if stage == 0 else 0)
            + (costs[-1] if stage == n_stages - 1 else 0)
        )

    # best[s][e]: the least possible maximum over stages 0..s holding layers [0, e); start[s][e]: where stage s starts then.
    best = [[float("inf")] * (n_layers + 1) for _ in range(n_stages)]
    start = [[0] * (n_layers + 1) for _ in range(n_stages)]
    for end in range(1, n_layers + 1):
        best[0][end] = span(0, end, 0)
    for stage in range(1, n_stages):
        for end in range(stage + 1, n_layers + 1):
            for first in range(stage, end):
                candidate = max(best[stage - 1][first], span(first, end, stage))
                if candidate < best[stage][end]:
                    best[stage][end], start[stage][end] = candidate, first
    starts, end = [], n_layers
    for stage in range(n_stages - 1, 0, -1):
        end = start[stage][end]
        starts.append(end)
    return (0, *reversed(starts))


def split_robot(model: RobotTransformer, n_stages: int, split: tuple[int, ...] | None) -> StageSplit:
    """The stages' layers, balanced by FLOPs or at ``split``; a one-line ValueError if they cannot be laid out."""
    n_layers = model.cfg.backbone.n_layers
    if n_layers < n_stages:
        raise ValueError(
            f"pp: {n_layers} backbone layers do not divide into {n_stages} stages (each stage needs a layer)"
        )
    costs = unit_flops(model)
    if split is None:
        starts = balanced_starts(costs, n_stages)
    else:
        if len(split) != n_stages - 1:
            raise ValueError(
                f"pipeline.split: {n_stages} stages need {n_stages - 1} split point(s) (the layer each stage after the first starts at), got {list(split)}"
            )
        if any(not 0 < point < n_layers for point in split) or list(split) != sorted(set(split)):
            raise ValueError(
                f"pipeline.split {list(split)}: split points must be increasing layer indices between 1 and {n_layers - 1}"
            )
        starts = (0, *split)
    stage_split = StageSplit(starts, n_layers, ())
    stage_costs = [sum(costs[1 + i] for i in stage_split.layers(s)) for s in range(n_stages)]
    stage_costs[0] += costs[0]
    stage_costs[-1] += costs[-1]
    return StageSplit(starts, n_layers, tuple(c / sum(costs) for c in stage_costs))


def check_pipeline(model: nn.Module, shape: MeshShape, config: PipelineConfig) -> StageSplit:
    """The split on ``shape``, or a one-line ValueError naming what the pipeline cannot take (the
    robot plan's ``check_robot`` checks what tensor parallelism must divide)."""
    if isinstance(model, RobotFlowTransformer):
        raise ValueError(
            "pp: the flow model's action expert runs after the whole backbone and its layer l attends to backbone layer l's keys "
            "and values, so a stage cannot hand on one activation; train post-training with fsdp, tp or fsdp_tp"
        )
    if not isinstance(model, RobotTransformer):
        raise ValueError(
            f"pp: no pipeline plan for {type(model).__name__} (the robot transformer of pretraining and midtraining has one)"
        )
    if config.schedule in ZERO_BUBBLE and shape.dp > 1:
        # Measured with uma parity: with FSDP, the separate weight-gradient pass gives wrong gradients
        # (the norms of the second stage's first layer). Interleaved1F1B interleaves as well and is right.
        raise ValueError(
            f"pipeline.schedule {config.schedule} with data parallelism (dp {shape.dp}) gives wrong gradients here; use Interleaved1F1B, or dp 1"
        )
    if model.environment_state_head is not None:
        raise ValueError(
            "pp: the environment-state head reads the first stage's prefix from the last stage; train it without pp (network.environment_state_weight 0)"
        )
    return split_robot(model, shape.pp * config.virtual_stages, config.split)


class RobotStage(nn.Module):
    """Stage ``index`` of ``n_stages`` of a robot transformer: embeddings on the first, its blocks, the loss on the last.

    Its mixture-of-experts layers' routing statistics (``stats``) are kept from each microbatch's
    forward and combined after the schedule's step (``combine_moe_stats``), so they describe the
    whole batch as without pp: the balancing bias moves on every microbatch's tokens, and the
    logged metrics are those of the batch.
    """

    def __init__(self, model: RobotTransformer, index: int, n_stages: int, layers: range):
        super().__init__()
        self.first, self.last = index == 0, index == n_stages - 1
        self.layers = nn.ModuleList(model.backbone.layers[i] for i in layers)
        # In a list: not submodules (the blocks hold them), and the stage's forward, unlike the
        # blocks', is not run again by an activation-checkpointing recompute.
        self._moe_stats: list[tuple[MoEFeedForward, list[dict]]] = [(layer, []) for _, layer in moe_layers(self.layers)]
        if self.first:
            self.embeddings = nn.ModuleList(
                model.get_submodule(name) for name in FIRST_STAGE_MODULES if getattr(model, name) is not None
            )
        if self.last:
            self.head = nn.ModuleList(model.get_submodule(name) for name in LAST_STAGE_MODULES)
        self._model = [model]  # in a list: not a submodule, so this stage's parameters are its own

    def forward(self, *inputs: torch.Tensor, text_mask: torch.Tensor, loss_targets: torch.Tensor | None = None):
        model = self._model[0]
        h = model.embed_sequence(*inputs[:3], text_mask, inputs[3]) if self.first else inputs[0]
        mask = model.sequence_padding_mask(text_mask)
        cos, sin = model.backbone.rope_cos, model.backbone.rope_sin
        for block in self.layers:
            h = block(h, cos, sin, prefix_len=model.cfg.prefix_len, key_padding_mask=mask)
        for layer, microbatches in self._moe_stats:
            microbatches.append(layer.stats)
        if not self.last:
            return h
        loss, predicted = model.action_loss_of(model.action_states(model.backbone.norm(h)), loss_targets)
        return loss.reshape(1), predicted  # [1]: the schedule merges microbatches' outputs along dim 0

    def combine_moe_stats(self, microbatches: int) -> None:
        """Leave on each MoE layer the statistics of the step's ``microbatches`` together: its last
        forwards (a schedule's first step also runs each stage once before, to learn the shapes)."""
        for layer, forwards in self._moe_stats:
            layer.stats = combined_stats(forwards[-microbatches:])
            forwards.clear()


def microbatch_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """The loss the last stage computed for its microbatch: the mean over its samples (the schedule
    then divides gradients by the number of microbatches, for the mean over the batch). Its one
    element summed: a new tensor, not a view, which the zero-bubble schedules detach in place."""
    return output[0].sum()


def apply_stage_tp(model: RobotTransformer, stage: RobotStage, tp_mesh) -> str:
    """Tensor parallelism inside a stage, as the robot plan lays out the whole model: the first stage
    takes its inputs as replicated DTensors into replicated tokenizers and keeps its rank's slice of
    the tokens before the first block; the blocks take and return that slice (so between stages
    travels a tp-th of the activations); the last stage gathers the tokens after the final norm for
    the column-wise action head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    frozen = [
        name for name, param in model.named_parameters() if not param.requires_grad
    ]  # SequenceParallel makes norms' weights trainable
    if stage.first:
        inputs = (Replicate(),) * 4  # images, state, text ids, action tokens; text_mask, a keyword, stays plain
        parallelize_module(stage, tp_mesh, {"": PrepareModuleInput(input_layouts=inputs, desired_input_layouts=inputs)})
        apply_tp_tokenizers(model, tp_mesh)
        action_embedding_layout(model, tp_mesh)
        parallelize_module(
            stage.layers[0],
            tp_mesh,
            {
                "": PrepareModuleInput(
                    input_layouts=(Replicate(), None, None),
                    desired_input_layouts=(Shard(1), None, None),
                    use_local_output=True,
                )
            },
        )
    apply_sequence_parallel_blocks(list(stage.layers), tp_mesh)
    if stage.last:
        parallelize_module(model.backbone, tp_mesh, {"norm": SequenceParallel()})
        parallelize_module(
            model.backbone,
            tp_mesh,
            {
                "norm": PrepareModuleOutput(
                    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=False
                )
            },
        )
        action_head_layout(model, tp_mesh)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return f"tensor parallel over {tp_mesh.size()} ranks in each stage (attention heads, feed-forward; sequence-parallel norms; action head)"


def drop_other_stages(model: RobotTransformer, held: list[range], first: bool, last: bool) -> None:
    """Set to None, in place, every layer, embedding and head this rank's stages do not hold."""
    kept = {i for layers in held for i in layers}
    for i in range(len(model.backbone.layers)):
        if i not in kept:
            model.backbone.layers[i] = None
    for names, keep in ((FIRST_STAGE_MODULES, first), (LAST_STAGE_MODULES, last)):
        if not keep:
            for name in names:
                parent, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(parent), attribute, None)


def pipeline_robot(
    model: RobotTransformer, mesh, config: ParallelConfig, pipeline: PipelineConfig, device: torch.device
) -> list[str]:
    """Cut ``model`` to this rank's stages, wrap them for data parallelism, and make ``model(...)`` run the schedule.

    Then ``model(images, state, text_ids, text_mask, action_tokens, loss_targets=...)`` runs one
    schedule step (forward and, with gradients enabled, backward) and returns (loss, predictions)
    of the whole batch on every rank, as the unsplit model's forward returns them.
    """
    pp_mesh = mesh["pp"]
    shape = MeshShape(*(mesh[name].size() for name in ("dp_replicate", "dp_shard", "tp")), pp=pp_mesh.size())
    split = check_pipeline(model, shape, pipeline)
    n_stages = len(split.shares)
    every_moe_layer = {
        name: layer.cfg.n_experts for name, layer in moe_layers(model)
    }  # before this rank drops other stages' layers
    indices = pipeline.stage_indices(pp_mesh.size(), pp_mesh.get_local_rank())
    drop_other_stages(model, [split.layers(i) for i in indices], first=0 in indices, last=n_stages - 1 in indices)
    modules = {i: RobotStage(model, i, n_stages, split.layers(i)) for i in indices}
    applied = []
    for stage in modules.values():
        applied += lay_out(
            stage, list(stage.layers), mesh, config, lambda stage=stage: [apply_stage_tp(model, stage, mesh["tp"])]
        )
    runtime = Pipeline(modules, n_stages, pipeline, pp_mesh, device, microbatch_loss, every_moe_layer)

    def forward(images, state, text_ids, text_mask, action_tokens, *, loss_targets=None, with_environment_state=False):
        if loss_targets is None or with_environment_state:
            raise ValueError(
                "a pipelined model computes its loss only: call it with loss_targets, without with_environment_state"
            )
        loss_dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # as the loss kernel's
        like = lambda microbatches: (torch.empty(microbatches, dtype=loss_dtype), torch.empty_like(loss_targets))  # noqa: E731
        losses, predicted = runtime.step(
            (images, state, text_ids, action_tokens),
            {"text_mask": text_mask, "loss_targets": loss_targets},
            loss_targets,
            like,
        )
        for stage in modules.values():
            stage.combine_moe_stats(runtime.step_microbatches)
        return losses.mean(), predicted

    model.forward = forward
    model.pipeline = runtime
    stages = f"{n_stages} stages" + (f" ({n_stages // pp_mesh.size()} per rank)" if n_stages > pp_mesh.size() else "")
    description = f"pipeline: {stages}, {pipeline.schedule}, {runtime.microbatches} microbatches; {split.describe()}"
    # Lines repeated for each of a rank's stages are said once.
    applied_once = list(dict.fromkeys(line for line in applied if line))
    evaluation = "evaluation: loss and token accuracy through the schedule; action errors need the whole model (uma validate on a checkpoint)"
    return [description, *applied_once, evaluation]
