"""Parallel plan of the robot backbone family (``RobotBase`` in uma_lightning.models.robot and its
subclasses): EP -> TP -> LoRA layouts -> AC -> compile -> data parallel -> inference methods.

The plan lays out what every robot model shares, the modality tokenizers and the backbone, and
asks each of the model's heads (``HeadPlan``, registered per model class) for the rest: which of
its blocks to wrap one by one, and the tensor-parallel layout of its modules. Heads of the
built-in models: the discrete action head (here), the environment-state head (here), the
flow-matching action expert (``plans/flow.py``).

Tensor parallel layout (Megatron style, with sequence parallelism):

- attention: wq, wk, wv column-wise (each rank owns n_heads / tp query heads and n_kv_heads / tp
  key/value heads), wo row-wise; feed-forward: w1, w3 column-wise, w2 row-wise. Each block thus
  needs one all-gather before and one reduce-scatter after attention and after the feed-forward.
- sequence parallel: between those matmuls (norms, residual adds) each rank holds S / tp tokens.
- the modality tokenizers and embeddings (under 1 % of the parameters) are replicated: every
  rank embeds the whole batch, then keeps its slice of the sequence for the backbone.
- a head reads the backbone's gathered (replicated) hidden states and returns plain tensors.

Every parameter becomes a DTensor on the tensor-parallel mesh, so gradient clipping, optimizers
and checkpoints handle one kind of tensor.

Mixture-of-experts layers: their experts are split over the ``ep`` ranks (``plans/experts.py``)
and laid out over the data-parallel ranks that hold the same experts on their own; the blocks'
data parallelism covers every other parameter. Under tensor parallelism (without ep) each rank
routes its sequence slice through the whole layer, whose gradients the tp ranks sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from uma_lightning.models import RobotBase, RobotTransformer, Transformer
from uma_lightning.models.lora import LoRALinear
from uma_lightning.models.moe import MoEFeedForward
from uma_lightning.parallel.apply import ParallelConfig, apply_ac, apply_compile, apply_ddp, apply_fsdp
from uma_lightning.parallel.mesh import MeshShape
from uma_lightning.parallel.plans.experts import (
    apply_expert_data_parallel,
    apply_expert_parallel,
    apply_moe_tensor_parallel,
    check_expert_parallel,
    expert_parameters,
)
from uma_lightning.parallel.plans.registry import HeadPlan, heads_for

# The observation's arguments every robot model's forward starts with: images, state, text ids, text mask.
OBSERVATION_INPUTS = 4
# Methods besides forward that run the model (evaluation, closed loop, export).
INFERENCE_METHODS = ("predict_actions",)
# The tensor-parallel split of a block's weights: column-wise layers split their output features
# (dim 0 of an nn.Linear weight), row-wise ones their input features (dim 1). The planner
# (``tools/planner``) reads these too, to predict each rank's shard.
BLOCK_COLWISE = ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3")
BLOCK_ROWWISE = ("attn.wo", "ffn.w2")


def check_robot(model: RobotBase, shape: MeshShape, config: ParallelConfig) -> None:
    check_expert_parallel(model, shape.ep, shape.world_size)
    if shape.tp == 1:
        return
    b = model.cfg.backbone
    if b.moe is not None and shape.ep > 1:
        raise ValueError(
            f"tp {shape.tp} with ep {shape.ep}: experts are either split over ep ranks or computed whole on each tp rank, not both"
        )
    if b.moe is not None and b.moe.aux_loss_weight:
        raise ValueError(
            f"tp {shape.tp}: moe.aux_loss_weight needs each sequence's tokens on one rank, and sequence parallelism splits them (size {b.name})"
        )
    sizes = {
        "n_heads": b.n_heads,
        "n_kv_heads": b.n_kv_heads,
        "ffn_dim": b.ffn_dim,
        "sequence length": model.backbone.max_seq_len,  # sequence parallelism splits the tokens
    }
    for head in heads_for(model):
        sizes.update(head.tp_sizes(model))
    bad = [f"{name} {value}" for name, value in sizes.items() if value % shape.tp]
    if bad:
        described = ", ".join(f"{name} {value}" for name, value in sizes.items())
        raise ValueError(f"tp {shape.tp} does not divide {', '.join(bad)} (model: {described})")


def replicated(attribute: str):
    """The tensor-parallel layout of a small head ``model.<attribute>``: its weights replicated, its
    output a plain tensor. Every rank computes it whole from the gathered hidden states."""

    def layout(model: nn.Module, tp_mesh) -> None:
        from torch.distributed.tensor import Replicate, distribute_module
        from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

        distribute_module(model.get_submodule(attribute), tp_mesh)
        parallelize_module(
            model,
            tp_mesh,
            {
                attribute: PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True
                )
            },
        )

    return layout


def apply_sequence_parallel_transformer(transformer: Transformer, tp_mesh) -> None:
    """A ``Transformer`` (backbone or expert) fed replicated embeddings: each rank keeps its slice of
    the tokens (a local split, no communication), the blocks are tensor-parallel, and the final hidden
    states are gathered into a replicated DTensor. Attention keys and values, and so a ``KVCache``,
    cover every token (after the all-gather) and this rank's key/value heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        transformer,
        tp_mesh,
        {
            "": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "norm": SequenceParallel(),
        },
    )
    parallelize_module(
        transformer,
        tp_mesh,
        {
            "": PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=False
            )
        },
    )
    apply_sequence_parallel_blocks(list(transformer.layers), tp_mesh)


def apply_sequence_parallel_blocks(blocks: list[nn.Module], tp_mesh) -> None:
    """Transformer blocks that take and return this rank's slice of the tokens, as plain tensors:
    attention heads and feed-forward split over the ranks, the norms sequence-parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for block in blocks:
        experts = isinstance(block.ffn, MoEFeedForward)
        whole = ("ffn.",) if experts else ()  # the MoE layer's own layout, below
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "ffn_norm": SequenceParallel(),
                # A MoE layer routes this rank's own tokens (apply_moe_tensor_parallel): no gather.
                "ffn": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Shard(1),) if experts else (Replicate(),),
                    use_local_output=experts,
                ),
                **{name: ColwiseParallel() for name in BLOCK_COLWISE if not name.startswith(whole)},
                **{
                    name: RowwiseParallel(output_layouts=Shard(1))
                    for name in BLOCK_ROWWISE
                    if not name.startswith(whole)
                },
            },
        )
        if experts:
            apply_moe_tensor_parallel(block.ffn, tp_mesh)


def apply_tp(model: RobotBase, tp_mesh, heads: list[HeadPlan]) -> str:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    # Frozen parameters stay frozen: SequenceParallel re-creates the norms' weights as trainable.
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    # Tensor inputs become replicated DTensors for the replicated tokenizers and heads; text_mask stays
    # a plain tensor because it only builds the attention mask.
    inputs = (Replicate(), Replicate(), Replicate(), None) + (Replicate(),) * sum(head.forward_inputs for head in heads)
    parallelize_module(model, tp_mesh, {"": PrepareModuleInput(input_layouts=inputs, desired_input_layouts=inputs)})
    apply_tp_tokenizers(model, tp_mesh)
    apply_sequence_parallel_transformer(model.backbone, tp_mesh)
    for head in heads:
        if head.tp_layout is not None:
            head.tp_layout(model, tp_mesh)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    moe = sum(isinstance(block.ffn, MoEFeedForward) for block in model.backbone.layers)
    experts = f"; {moe} MoE layers whole on each rank, for its slice of the sequence" if moe else ""
    return f"tensor parallel over {tp_mesh.size()} ranks (attention heads, feed-forward; sequence-parallel norms{experts}; heads: {', '.join(h.name for h in heads) or 'none'})"


def apply_tp_tokenizers(model: RobotBase, tp_mesh) -> None:
    """The modality tokenizers replicated, fed replicated DTensors (the caller lays out the model's inputs)."""
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    for tokenizer in (model.text_embed, model.image_tokenizer, model.camera_embed, model.state_proj):
        distribute_module(tokenizer, tp_mesh)  # parameters and buffers replicated as DTensors
    if model.instruction_pooling is not None:
        parallelize_module(
            model,
            tp_mesh,
            {
                # The pooling mixes the replicated byte embeddings with the plain text_mask: done on local
                # tensors, and its result enters the replicated image tokenizer as a replicated DTensor.
                "instruction_pooling": PrepareModuleInput(
                    input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None), use_local_output=True
                ),
                "image_tokenizer": PrepareModuleInput(
                    input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate())
                ),
            },
        )


def apply_tp_lora(model: nn.Module, tp_mesh) -> str:
    """LoRA adapters follow their layer's layout: tensor parallelism distributes a linear layer's own
    weight and bias, not the adapters. A row-wise layer's input is split by features, so its A is
    split the same way; every other adapter weight is replicated (they are rank x features, small)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    adapted = [
        m
        for m in model.modules()
        if isinstance(m, LoRALinear) and isinstance(m.weight, DTensor) and not isinstance(m.lora_a, DTensor)
    ]
    for layer in adapted:
        rowwise = layer.weight.placements == (Shard(1),)
        for name, placement in (("lora_a", Shard(1) if rowwise else Replicate()), ("lora_b", Replicate())):
            param = getattr(layer, name)
            layer.register_parameter(
                name,
                nn.Parameter(distribute_tensor(param.data, tp_mesh, [placement]), requires_grad=param.requires_grad),
            )
    return f"LoRA adapters of {len(adapted)} tensor-parallel layers laid out with them" if adapted else ""


def apply_inference_methods(model: nn.Module, tp: bool) -> str:
    """Inference calls ``predict_actions``, not ``forward``: data parallelism gathers the parameters
    around it as around forward, and under tensor parallelism its plain inputs (and the noise and
    times it makes) count as replicated, as forward's are made."""
    from torch.distributed.fsdp import register_fsdp_forward_method
    from torch.distributed.tensor.experimental import implicit_replication

    methods = [name for name in INFERENCE_METHODS if callable(getattr(model, name, None))]
    for name in methods:
        if tp:
            method = getattr(model, name)

            @functools.wraps(method)
            def replicating(*args, _method=method, **kwargs):
                with implicit_replication():
                    return _method(*args, **kwargs)

            setattr(model, name, replicating)
        register_fsdp_forward_method(model, name)  # no-op without FSDP or DDP
    if tp:
        return (
            "validation without predicted action chunks (decoding adds one token at a time, which sequence "
            "parallelism cannot split over the tp ranks): its loss and token accuracy are still validated"
        )
    return ""


def robot_blocks(model: RobotBase) -> list[nn.Module]:
    """The blocks wrapped one by one (checkpointing, compile, FSDP or DDP): the backbone's, then each head's."""
    return list(model.backbone.layers) + [block for head in heads_for(model) for block in head.blocks(model)]


def parallelize_robot(model: RobotBase, mesh, config: ParallelConfig) -> list[str]:
    """Apply the plan in place on ``mesh`` (dims dp_replicate, dp_shard, tp; ep and the experts' own
    data-parallel dimension with expert parallelism, see ``mesh.py``); returns what was applied.

    The layout (``lay_out``), then the inference methods, so their wrappers see the final module.
    """
    heads = heads_for(model)
    tp = mesh["tp"].size() > 1
    applied = lay_out(
        model,
        robot_blocks(model),
        mesh,
        config,
        lambda: [apply_tp(model, mesh["tp"], heads), apply_tp_lora(model, mesh["tp"])],
    )
    applied.append(apply_inference_methods(model, tp))
    return [line for line in applied if line]


def lay_out(
    root: nn.Module, blocks: list[nn.Module], mesh, config: ParallelConfig, tensor_parallel: Callable[[], list[str]]
) -> list[str]:
    """Lay out ``root`` (a model, or a pipeline stage) and its ``blocks`` on ``mesh``, in place;
    ``tensor_parallel`` lays out its tensor-parallel part. Returns what was applied.

    The order matters. EP first: it splits the experts over their ranks, which data parallelism
    must then leave alone. TP next: it turns weights into DTensor shards and adds the input and
    output redistributions that the later steps must wrap; the LoRA adapters then follow their
    layers' layouts. AC before compile, so the compiled block includes the recompute policy.
    Data parallelism after, so its per-block all-gathers and reduce-scatters wrap whole
    (checkpointed, compiled) blocks: the experts' first (nested in the blocks, over their own
    ranks), then the blocks, then the root.
    """
    expert_dp_dim = next(
        (dim for dim in ("expert_shard", "expert_replicate") if dim in (mesh.mesh_dim_names or ())), None
    )
    applied, experts = [], set()
    if expert_dp_dim:
        applied.append(apply_expert_parallel(root, mesh["ep"]))
        experts = expert_parameters(root)
    if mesh["tp"].size() > 1:
        applied += tensor_parallel()
    applied.append(apply_ac(blocks, config))
    applied.append(apply_compile(blocks, config))
    sharded = mesh["dp_shard"].size() > 1
    if expert_dp_dim and mesh[expert_dp_dim].size() > 1:
        applied.append(apply_expert_data_parallel(root, mesh, expert_dp_dim, sharded, config))
        experts = set()  # wrapped on their own: the blocks' data parallelism skips them
    if sharded:
        dp_mesh = mesh["dp_shard"] if mesh["dp_replicate"].size() == 1 else mesh["dp_replicate", "dp_shard"]
        applied.append(apply_fsdp(blocks, root, dp_mesh, config, ignored=experts))
    elif mesh["dp_replicate"].size() > 1:
        applied.append(apply_ddp(blocks, root, mesh["dp_replicate"], config, ignored=experts))
    return applied


# ---- the heads of the built-in robot models --------------------------------------------------------


def discrete_action_layout(model: RobotTransformer, tp_mesh) -> None:
    """The action embeddings replicated; the action head column-wise over the bins, its logits
    gathered; the fused loss takes the gathered hidden states and the head's weight whole (its
    gradient goes back to the shards)."""
    action_embedding_layout(model, tp_mesh)
    action_head_layout(model, tp_mesh)


def action_embedding_layout(model: RobotTransformer, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    distribute_module(model.action_embed, tp_mesh)
    distribute_module(model.action_dim_embed, tp_mesh)
    # Its input (action-dimension indices) is created inside forward.
    parallelize_module(
        model,
        tp_mesh,
        {"action_dim_embed": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))},
    )


def action_head_layout(model: RobotTransformer, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    parallelize_module(
        model,
        tp_mesh,
        {
            "action_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "action_loss": PrepareModuleInput(
                input_layouts=(Replicate(), Shard(0), None),
                desired_input_layouts=(Replicate(), Replicate(), None),
                use_local_output=True,
            ),
        },
    )


DISCRETE_ACTION_HEAD = HeadPlan(
    "discrete actions",
    tp_sizes=lambda model: {"n_action_bins": model.cfg.n_action_bins},
    tp_layout=discrete_action_layout,
    forward_inputs=1,  # the action tokens
    tp_colwise=("action_head",),
)

ENVIRONMENT_STATE_HEAD = HeadPlan(
    "environment state",
    tp_layout=replicated("environment_state_head"),
    present=lambda model: model.environment_state_head is not None,
)
