"""Model-independent steps of a parallel plan: activation checkpointing, compile, and data parallelism.

Each ``apply_*`` function changes modules in place, keeps parameter names unchanged (so
checkpoints load into an unwrapped model), and returns a short description for the plan's log
line. A model's plan (``plans/``) adds its own tensor-parallel layout and calls these in order.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
from torch import nn

from uma_lightning.default_dtype import default_dtype

ActivationCheckpointing = Literal["none", "full", "ops"]
Compile = Literal["none", "blocks"]


@dataclass(frozen=True)
class ParallelConfig:
    """What a plan applies besides the mesh layout (the ``wrapping`` section of ``MeshStrategy``).

    ``bf16_params`` is no setting: the strategy sets it from the trainer's precision (``with_bf16_params``).

    Args:
        activation_checkpointing: none, full (recompute whole blocks) or ops (keep matmul outputs, recompute the rest).
        ac_every_n_blocks: Checkpoint every n-th block only (1: all of them).
        compile: torch.compile none, or blocks (each transformer block).
        compile_backend: inductor generates kernels; aot_eager only traces (for debugging).
        reshard_after_forward: FSDP frees gathered parameters after each block's forward (less memory,
            one more all-gather in backward).
        cpu_offload: FSDP keeps parameters, gradients and optimizer state in CPU memory.
    """

    activation_checkpointing: ActivationCheckpointing = "none"
    ac_every_n_blocks: int = 1
    compile: Compile = "none"
    compile_backend: str = "inductor"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    bf16_params: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in get_args(ActivationCheckpointing):
            raise ValueError(
                f"wrapping.activation_checkpointing must be none, full or ops, got {self.activation_checkpointing!r}"
            )
        if self.compile not in get_args(Compile):
            raise ValueError(f"wrapping.compile must be none or blocks, got {self.compile!r}")
        if self.ac_every_n_blocks < 1:
            raise ValueError(f"wrapping.ac_every_n_blocks must be >= 1, got {self.ac_every_n_blocks}")

    def with_bf16_params(self, bf16_params: bool) -> ParallelConfig:
        """This config, FSDP gathering parameters in bf16 (and reducing gradients in fp32) if ``bf16_params``."""
        config = replace(self)
        object.__setattr__(config, "bf16_params", bf16_params)  # frozen, and no init argument: not a setting
        return config


# Selective checkpointing keeps the outputs of these ops (expensive to recompute) and recomputes
# everything else in a block (norms, activations, rotary embeddings: cheap, but memory-hungry).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def apply_ac(blocks: list[nn.Module], config: ParallelConfig) -> str:
    """Recompute activations of every ``ac_every_n_blocks``-th block in backward instead of storing them."""
    if config.activation_checkpointing == "none":
        return ""
    from torch.distributed._composable import checkpoint
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def save_matmuls(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        if config.activation_checkpointing == "ops":
            forward, recompute = create_selective_checkpoint_contexts(save_matmuls)
        else:
            forward, recompute = nullcontext(), nullcontext()
        return forward, _under_default_dtype(torch.get_default_dtype(), recompute)

    chosen = blocks[:: config.ac_every_n_blocks]
    for block in chosen:
        checkpoint(block, context_fn=contexts)
    what = "matmul outputs saved, the rest recomputed" if config.activation_checkpointing == "ops" else "full"
    return f"activation checkpointing ({what}) on {len(chosen)} of {len(blocks)} blocks"


@contextmanager
def _under_default_dtype(dtype: torch.dtype, inner):
    """``inner`` with torch's default dtype set to the forward's. Lightning's "true" precisions set it
    around the forward only, so a block recomputed in backward otherwise ran under another one: a
    compiled block's guards then failed, and it was compiled a second time (2 of 4 compilations)."""
    with default_dtype(dtype), inner:
        yield


GRAPHS_PER_BLOCK_KIND = 8  # dynamo's default recompile_limit, for each kind of block
# Every kind of block compiled in this process: they share dynamo's cache of their class's forward.
_compiled_block_kinds: set = set()


def apply_compile(blocks: list[nn.Module], config: ParallelConfig) -> str:
    """torch.compile each block, in place (nn.Module.compile), so parameter names gain no "_orig_mod." prefix.

    Blocks of one model share their shapes, so one compiled graph serves them all. The whole
    model is not compiled as one graph: in torch 2.13, tracing it with DTensor parameters
    (tensor parallel, DDP) recurses without end.
    """
    if config.compile == "none":
        return ""
    # Dynamo keeps at most ``recompile_limit`` graphs of one function (8 by default) and runs any
    # further variant uncompiled, and all blocks share their class's forward. Each kind of block is
    # compiled for training and for evaluation (no grad, EMA weights), for a shorter last batch, and
    # with or without a KV cache: a flow model's backbone and action expert hit 8 in 6 steps. Frozen
    # parameters make a kind too (dynamo guards on requires_grad): the flow model's last backbone
    # block, an EMA copy. Process-wide, like the cache it bounds.
    kinds = {(type(block), tuple((tuple(p.shape), p.requires_grad) for p in block.parameters())) for block in blocks}
    _compiled_block_kinds.update(kinds)
    limit = GRAPHS_PER_BLOCK_KIND * len(_compiled_block_kinds)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for block in blocks:
        block.compile(backend=config.compile_backend)
    return f"torch.compile ({config.compile_backend}) per block ({len(kinds)} kind(s) of block; up to {limit} graphs of a block's forward)"


def data_parallel_policies(config: ParallelConfig):
    """FSDP2's (and replicate's) mixed-precision and offload policies for ``config``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    # bf16 compute and all-gathers halve memory traffic; gradients are reduced in fp32 so the
    # sum over many ranks does not lose the small contributions.
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.bf16_params
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.cpu_offload else OffloadPolicy()
    return mp_policy, offload


def apply_fsdp(
    blocks: list[nn.Module], root: nn.Module, dp_mesh, config: ParallelConfig, ignored: set[nn.Parameter] | None = None
) -> str:
    """FSDP2 on each block, then on the root for the parameters outside the blocks.

    A 1-D ``dp_mesh`` shards across all its ranks (FSDP); a 2-D (replicate, shard) mesh shards
    within groups and all-reduces across them (HSDP). ``ignored`` parameters are left as they are
    (experts that expert parallelism already split over these ranks).
    """
    from torch.distributed.fsdp import fully_shard

    mp_policy, offload = data_parallel_policies(config)
    for block in blocks:
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=ignored,
        )
    # The root's parameters are needed again right at the start of backward: keep them gathered.
    fully_shard(
        root,
        mesh=dp_mesh,
        reshard_after_forward=False,
        mp_policy=mp_policy,
        offload_policy=offload,
        ignored_params=ignored,
    )
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP"
    details = [f"reshard_after_forward={config.reshard_after_forward}"]
    if config.bf16_params:
        details.append("bf16 params, fp32 reduce")
    if config.cpu_offload:
        details.append("CPU offload")
    return f"{kind} over {'x'.join(map(str, dp_mesh.shape))} ranks per block and at the root ({', '.join(details)})"


def reshard_data_parallel(module: nn.Module) -> None:
    """Put the parameters of every FSDP2- or replicate-wrapped submodule of ``module`` back in their
    sharded (DTensor) form; nothing else changes. Only backward does this after a forward that kept
    them gathered (an FSDP root, every replicated module), so a module that runs forward only (an
    EMA copy) would otherwise hold plain, whole tensors beside the trained model's DTensors."""
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def apply_ddp(
    blocks: list[nn.Module], root: nn.Module, dp_mesh, config: ParallelConfig, ignored: set[nn.Parameter] | None = None
) -> str:
    """Full replicas with gradients all-reduced per block, so each block's reduction overlaps the backward of the next."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp_policy, _ = data_parallel_policies(config)
    for block in blocks:
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
    replicate(root, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
    return f"DDP over {dp_mesh.size()} replicas, gradients all-reduced per block" + (
        " (bf16 params, fp32 reduce)" if config.bf16_params else ""
    )
