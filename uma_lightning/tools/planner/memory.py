"""Memory of one rank under a layout: model state (exact), activations and temporary buffers (estimated).

Model state follows how the strategies shard (``parallel/plans/robot.py``, ``parallel/apply.py``):
tensor parallelism splits a weight on its tp dim as ``torch.chunk`` does (DTensor ``Shard``), FSDP2
then splits the tp-local tensor's dim 0 the same way over dp_shard (the first ranks get the larger
pieces), expert parallelism splits stacked expert weights on dim 0 over ep, and a pipeline stage
holds its own layers only. AdamW keeps two states per parameter in its dtype and a 4-byte step.

Activations count what autograd saves for backward, measured with a saved-tensors hook on the CPU
kernels (``planner/check.py``) and written here per block from the model's shapes; a network outside
the robot family has them from the same hook over a traced step (``model.py``), scaled to the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from uma_lightning.tools.planner.layout import Layout
from uma_lightning.tools.planner.model import ModelFacts, Param

ADAM_STATES = 2  # exp_avg, exp_avg_sq
ADAM_STEP_BYTES = 4  # AdamW's per-parameter step counter, a float32 scalar tensor
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
LIGHTNING_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}  # the short names Lightning also takes


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a Lightning precision setting keeps."""

    name: str
    param_bytes: int  # stored weights, their gradients and AdamW states
    compute_bytes: int  # activations, gathered weights under FSDP mixed precision
    reduce_bytes: int  # gradients as they are reduced

    @classmethod
    def of(cls, precision: str) -> Precision:
        precision = LIGHTNING_ALIASES.get(precision, precision)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} (the planner models {', '.join(PRECISIONS)})")
        if precision.endswith("-true") and precision != "32-true":
            return cls(precision, 2, 2, 2)
        if "mixed" in precision:
            return cls(precision, 4, 2, 4)  # fp32 master weights, bf16/fp16 compute, fp32 reduction
        return cls(precision, 4, 4, 4)


def chunk(size: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` cuts ``size`` into ``parts``: ceil-sized pieces, the last ones short or empty."""
    piece = -(-size // parts)
    return max(0, min(size, (index + 1) * piece) - index * piece)


def _shard_group(param: Param, layout: Layout) -> int:
    """The ranks FSDP shards ``param`` over: dp_shard, or for expert weights what ep leaves of it
    (with dp_shard 1, ep is carved out of dp_replicate and nothing is sharded)."""
    return layout.dp_shard // layout.ep if param.expert and layout.dp_shard > 1 else layout.dp_shard


def _model_parallel_shape(param: Param, layout: Layout, tp_rank: int = 0, ep_rank: int = 0) -> list[int]:
    """``param``'s piece after tensor and expert parallelism, before FSDP."""
    shape = list(param.shape)
    if layout.tp > 1 and param.tp_dim is not None:
        shape[param.tp_dim] = chunk(shape[param.tp_dim], layout.tp, tp_rank)
    if param.expert and layout.ep > 1:
        shape[0] = chunk(shape[0], layout.ep, ep_rank)
    return shape


def local_shape(param: Param, layout: Layout, tp_rank: int = 0, shard_rank: int = 0) -> tuple[int, ...]:
    """The shape of ``param``'s piece on the rank at (tp_rank, shard_rank) of its stage. Expert
    weights split over ep consecutive shard ranks and are sharded across the ep groups."""
    ep_rank, fsdp_rank = (shard_rank % layout.ep, shard_rank // layout.ep) if param.expert else (0, shard_rank)
    shape = _model_parallel_shape(param, layout, tp_rank, ep_rank)
    group = _shard_group(param, layout)
    if group > 1 and shape:
        shape[0] = chunk(shape[0], group, fsdp_rank)
    return tuple(shape)


def padded_shape(param: Param, layout: Layout) -> tuple[int, ...]:
    """The piece FSDP2 gathers: the tp- and ep-local tensor, dim 0 padded to a multiple of its shard group."""
    shape = _model_parallel_shape(param, layout)
    group = _shard_group(param, layout)
    if group > 1 and shape:
        shape[0] = -(-shape[0] // group) * group
    return tuple(shape)


def stage_params(facts: ModelFacts, layout: Layout, stage: int) -> list[Param]:
    """The parameters pipeline rank ``stage`` holds (all of them without a pipeline): the tokenizers
    and embeddings with the first stage, its stages' layers as the pipeline plan splits them (by
    FLOPs), the final norm and heads with the last."""
    if layout.pp == 1:
        return list(facts.params)
    layers = _stage_layers(facts, layout.pp, layout.virtual_stages, stage)
    return [p for p in facts.params if p.layer in layers]


@functools.cache
def _stage_layers(facts: ModelFacts, pp: int, virtual_stages: int, rank: int) -> frozenset[int]:
    """Backbone layers on pipeline rank ``rank``, with -1 (before the backbone) and n_layers (after it) where it holds those."""
    from uma_lightning.parallel.plans.pipeline import split_robot

    n_stages = pp * virtual_stages
    indices = Layout(pp=pp, virtual_stages=virtual_stages).pipeline_config().stage_indices(pp, rank)
    split = split_robot(facts.model, n_stages, None)
    layers = {layer for index in indices for layer in split.layers(index)}
    return frozenset(
        layers | ({-1} if 0 in indices else set()) | ({facts.n_layers} if n_stages - 1 in indices else set())
    )


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def rank_state(
    facts: ModelFacts, layout: Layout, precision: Precision, stage: int = 0, tp_rank: int = 0, shard_rank: int = 0
) -> StateBytes:
    """Parameter, gradient and AdamW bytes of one rank, exactly as the sharded tensors hold them."""
    params = grads = optimizer = 0
    for param in stage_params(facts, layout, stage):
        numel = math.prod(local_shape(param, layout, tp_rank, shard_rank))
        params += numel * precision.param_bytes
        if param.trainable:
            grads += numel * precision.param_bytes
            optimizer += ADAM_STATES * numel * precision.param_bytes + ADAM_STEP_BYTES
    return StateBytes(params, grads, optimizer)


def mesh_only(layout: Layout) -> Layout:
    """``layout`` without what does not move weights (checkpointing, micro-batches): the key of the caches below."""
    return dataclasses.replace(layout, ac="none", microbatches=1)


def largest_state(facts: ModelFacts, layout: Layout, precision: Precision) -> StateBytes:
    """The rank holding the most: the first tp and shard rank (``torch.chunk`` gives them the
    larger pieces) of the heaviest pipeline stage."""
    return _largest_state(facts, mesh_only(layout), precision)


@functools.lru_cache(maxsize=1024)
def _largest_state(facts: ModelFacts, layout: Layout, precision: Precision) -> StateBytes:
    return max((rank_state(facts, layout, precision, stage) for stage in range(layout.pp)), key=lambda s: s.total)


def unit_elements(
    facts: ModelFacts, layout: Layout, trainable_only: bool = False, stage: int = 0
) -> tuple[int, list[int]]:
    """Elements FSDP gathers (padded) per unit of pipeline rank ``stage``: (the root's, each block's)."""
    return _unit_elements(facts, mesh_only(layout), trainable_only, stage)


@functools.lru_cache(maxsize=1024)
def _unit_elements(facts: ModelFacts, layout: Layout, trainable_only: bool, stage: int) -> tuple[int, list[int]]:
    units: dict[int, int] = {}
    for param in stage_params(facts, layout, stage):
        if param.trainable or not trainable_only:
            units[param.unit] = units.get(param.unit, 0) + math.prod(padded_shape(param, layout))
    root = units.pop(-1, 0)
    return root, list(units.values())


# ---- activations ---------------------------------------------------------------------------------


def block_activations(facts: ModelFacts, batch: int, layout: Layout) -> int:
    """Elements one block saves for backward, for ``batch`` samples, without checkpointing. Per
    norm: its input, output and 1/rms (sequence-parallel: S/tp tokens) and the matmuls' input
    (gathered: all S tokens); attention: q, k, v, output, log-sum-exp and the out projection's input
    (heads split over tp) and the float mask of the prefix-causal pattern [S, S]; feed-forward:
    the SwiGLU gate's two inputs, its output and the down projection's input (split over tp; a
    MoE layer's on this rank's S/tp tokens, top_k times)."""
    b, seq, tp = facts.cfg.backbone, facts.cfg.seq_len, layout.tp
    tokens, local_tokens = batch * seq, batch * seq // tp
    ffn_tokens = tokens if b.moe is None else local_tokens  # a MoE layer takes this rank's slice, not gathered
    norms = 2 * (2 * local_tokens * b.dim + local_tokens) + (tokens + ffn_tokens) * b.dim
    heads, kv_heads = b.n_heads // tp, max(1, b.n_kv_heads // tp)
    attention = tokens * b.head_dim * (3 * heads + 2 * kv_heads) + batch * heads * seq + batch * seq * seq
    if b.moe is not None:
        moe = b.moe
        routed = ffn_tokens * moe.top_k
        feed_forward = (
            4 * routed * moe.hidden(b.ffn_dim)
            + 4 * ffn_tokens * moe.n_shared * moe.hidden(b.ffn_dim)
            + ffn_tokens * moe.n_experts
            + 2 * routed * b.dim
        )
    else:
        feed_forward = 4 * tokens * b.ffn_dim // tp
    return norms + attention + feed_forward


def checkpointed_block(facts: ModelFacts, batch: int, layout: Layout) -> int:
    """Elements a block keeps under ``layout.ac``: none keeps everything; full keeps its input;
    ops keeps its input and the outputs of its matmuls and attention, and recomputes the rest."""
    b, seq, tp = facts.cfg.backbone, facts.cfg.seq_len, layout.tp
    block_input = batch * seq // tp * b.dim
    if layout.ac == "none":
        return block_activations(facts, batch, layout)
    if layout.ac == "full":
        return block_input
    tokens = batch * seq
    heads, kv_heads = b.n_heads // tp, max(1, b.n_kv_heads // tp)
    projections = (
        tokens * b.head_dim * (2 * heads + 2 * kv_heads) + batch * heads * seq
    )  # q, k, v, attention output and its log-sum-exp
    return block_input + projections + 2 * tokens * b.dim + 2 * tokens * b.ffn_dim // tp


def outside_activations(facts: ModelFacts, batch: int, layout: Layout) -> tuple[int, int]:
    """Elements saved outside the blocks: (before the backbone: the images as floats for the patch
    projection; after it: the final norm's tensors and the hidden states the fused loss reads)."""
    cfg, tp = facts.cfg, layout.tp
    spec = cfg.spec
    images = batch * spec.n_obs_steps * len(spec.cameras) * spec.image_size[0] * spec.image_size[1] * 3
    local_tokens = batch * cfg.seq_len // tp
    after = 2 * local_tokens * cfg.backbone.dim + local_tokens + batch * cfg.n_action_tokens * cfg.backbone.dim
    return images, after


def in_flight_microbatches(layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once: all of them without a
    pipeline's 1F1B order (one at a time under plain accumulation), ``pp`` under 1F1B, and under
    the interleaved schedule a share (pp - 1) / (pp v) more for the extra warm-up chunks."""
    if layout.pp == 1:
        return 1
    held = min(layout.microbatches, layout.pp)
    return held * (1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)) if layout.virtual_stages > 1 else held


def activation_bytes(facts: ModelFacts, layout: Layout, precision: Precision, global_batch: int) -> int:
    """Peak saved activations of the first stage's rank (the one holding the most micro-batches)."""
    batch = global_batch // layout.dp // layout.microbatches
    if facts.traced:
        return facts.traced(layout.tp).at(batch, precision.compute_bytes)  # no pipeline: one micro-batch at a time
    layers = facts.n_layers // layout.pp
    before, after = outside_activations(facts, batch, layout)
    per_microbatch = layers * checkpointed_block(facts, batch, layout) + before + (after if layout.pp == 1 else 0)
    # Under checkpointing, backward rebuilds what one block did not keep, one block at a time, on top of the rest.
    recompute = block_activations(facts, batch, layout) - checkpointed_block(facts, batch, layout)
    return int((per_microbatch * in_flight_microbatches(layout) + recompute) * precision.compute_bytes)


# ---- temporary buffers ---------------------------------------------------------------------------


def buffer_bytes(facts: ModelFacts, layout: Layout, precision: Precision) -> int:
    """The largest temporaries: under FSDP the root's gathered weights (kept for the whole step),
    two gathered blocks (the running one and the prefetched next) and one block's unsharded
    gradients before their reduce-scatter; without FSDP, under mixed precision, autocast's
    low-precision copies of the weights (cached for the forward)."""
    root, blocks = unit_elements(facts, layout)
    largest_block = max(blocks, default=0)
    if layout.dp_shard > 1:
        return (
            root * precision.compute_bytes
            + 2 * largest_block * precision.compute_bytes
            + largest_block * precision.reduce_bytes
        )
    if precision.compute_bytes < precision.param_bytes:
        return (root + sum(blocks)) * precision.compute_bytes
    return 0
