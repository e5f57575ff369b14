"""Parallel plan of ``RobotTransformer`` (uma_lightning.models.robot): TP -> AC -> compile -> data parallel.

Tensor parallel layout (Megatron style, with sequence parallelism):

- attention: wq, wk, wv column-wise (each rank owns n_heads / tp query heads and n_kv_heads / tp
  key/value heads), wo row-wise; feed-forward: w1, w3 column-wise, w2 row-wise. Each block thus
  needs one all-gather before and one reduce-scatter after attention and after the feed-forward.
- sequence parallel: between those matmuls (norms, residual adds) each rank holds S / tp tokens.
- the modality tokenizers and embeddings (under 1 % of the parameters) are replicated: every
  rank embeds the whole batch, then keeps its slice of the sequence for the backbone.
- the action head is column-wise over the bins, its logits gathered so the loss sees them whole;
  the optional environment-state head (a few outputs) is replicated and returns plain tensors.

Every parameter becomes a DTensor on the tensor-parallel mesh, so gradient clipping, optimizers
and checkpoints handle one kind of tensor.
"""

from __future__ import annotations

from torch import nn

from uma_lightning.models import RobotTransformer
from uma_lightning.parallel.apply import ParallelConfig, apply_ac, apply_compile, apply_ddp, apply_fsdp
from uma_lightning.parallel.mesh import MeshShape


def check_robot(model: RobotTransformer, shape: MeshShape, config: ParallelConfig) -> None:
    if shape.tp == 1:
        return
    b = model.cfg.backbone
    sizes = {
        "n_heads": b.n_heads,
        "n_kv_heads": b.n_kv_heads,
        "ffn_dim": b.ffn_dim,
        "n_action_bins": model.cfg.n_action_bins,
        "sequence length": model.cfg.seq_len,  # sequence parallelism splits the tokens
    }
    bad = [f"{name} {value}" for name, value in sizes.items() if value % shape.tp]
    if bad:
        described = ", ".join(f"{name} {value}" for name, value in sizes.items())
        raise ValueError(f"tp {shape.tp} does not divide {', '.join(bad)} (model: {described})")


def apply_tp(model: RobotTransformer, tp_mesh) -> str:
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for tokenizer in (model.text_embed, model.image_tokenizer, model.camera_embed, model.state_proj, model.action_embed, model.action_dim_embed):
        distribute_module(tokenizer, tp_mesh)  # parameters and buffers replicated as DTensors
    parallelize_module(
        model,
        tp_mesh,
        {
            # Tensor inputs become replicated DTensors for the replicated tokenizers; text_mask stays a
            # plain tensor because it only builds the attention mask.
            "": PrepareModuleInput(
                input_layouts=(Replicate(), Replicate(), Replicate(), None, Replicate()),
                desired_input_layouts=(Replicate(), Replicate(), Replicate(), None, Replicate()),
            ),
            # Its input (action-dimension indices) is created inside forward.
            "action_dim_embed": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            # Each rank keeps its slice of the sequence (a local split, no communication) ...
            "backbone": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
            "backbone.norm": SequenceParallel(),
            # ... and the final hidden states are gathered for the head, which slices the action positions.
            "action_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        },
    )
    if model.environment_state_head is not None:
        distribute_module(model.environment_state_head, tp_mesh)
        parallelize_module(
            model, tp_mesh, {"environment_state_head": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True)}
        )
    if model.instruction_pooling is not None:
        parallelize_module(
            model,
            tp_mesh,
            {
                # The pooling mixes the replicated byte embeddings with the plain text_mask: done on local
                # tensors, and its result enters the replicated image tokenizer as a replicated DTensor.
                "instruction_pooling": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None), use_local_output=True),
                "image_tokenizer": PrepareModuleInput(input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate())),
            },
        )
    parallelize_module(model.backbone, tp_mesh, {"": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=False)})
    for block in model.backbone.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return f"tensor parallel over {tp_mesh.size()} ranks (attention heads, feed-forward, action bins; sequence-parallel norms)"


def parallelize_robot(model: RobotTransformer, mesh, config: ParallelConfig) -> list[str]:
    """Apply the plan in place on ``mesh`` (dims dp_replicate, dp_shard, tp); returns what was applied.

    The order matters. TP first: it turns weights into DTensor shards and adds the input and
    output redistributions that the later steps must wrap. AC before compile, so the compiled
    block includes the recompute policy. Data parallelism last, so its per-block
    all-gathers and reduce-scatters wrap whole (checkpointed, compiled) blocks.
    """
    blocks: list[nn.Module] = list(model.backbone.layers)
    applied = []
    if mesh["tp"].size() > 1:
        applied.append(apply_tp(model, mesh["tp"]))
    applied.append(apply_ac(blocks, config))
    applied.append(apply_compile(blocks, config))
    if mesh["dp_shard"].size() > 1:
        dp_mesh = mesh["dp_shard"] if mesh["dp_replicate"].size() == 1 else mesh["dp_replicate", "dp_shard"]
        applied.append(apply_fsdp(blocks, model, dp_mesh, config))
    elif mesh["dp_replicate"].size() > 1:
        applied.append(apply_ddp(blocks, model, mesh["dp_replicate"], config))
    return [line for line in applied if line]
