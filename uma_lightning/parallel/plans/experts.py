"""Expert parallelism for the mixture-of-experts layers of any backbone (``models/moe.py``).

Over an ``ep`` group of P ranks, rank r keeps experts [r E/P, (r+1) E/P) of every MoE layer: each
stacked expert weight becomes a DTensor sharded on dim 0 over the group, so checkpoints still hold
whole [E, ...] tensors under the plain names and load under any other layout. Routers, shared
experts, attention and the bias buffer stay replicated (the bias moves the same way on every rank,
from counts summed over all ranks).

Each layer's ``dispatch`` becomes: send every token choice to the rank owning its expert
(all-to-all, uneven splits), run the local experts on what arrived, send the outputs back
(all-to-all the other way). Both all-to-alls carry gradients. The combine that follows is the
model's own: each choice's output lands in its own slot, so there is no atomic accumulation and
results do not depend on arrival order.

Gradients: an expert's gradient on its owner sums over every token routed to it from every rank
of the group, i.e. over P ranks' losses. The ep ranks are data-parallel ranks, whose losses data
parallelism averages, so the experts' gradients are scaled by 1 / P on the way in. Their own data
parallelism (``apply_expert_data_parallel``: FSDP or DDP over the ranks that hold the same
experts, ``mesh.py``) then averages over the rest, which gives the mean over every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from uma_lightning.kernels import expert_feed_forward
from uma_lightning.models.moe import GroupedExperts, MoEFeedForward, moe_layers
from uma_lightning.parallel.apply import ParallelConfig, data_parallel_policies

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def check_expert_parallel(model: nn.Module, ep: int, world_size: int) -> None:
    """One-line ValueError when ``ep`` cannot lay out this model's experts on ``world_size`` processes."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"ep {ep} does not divide the world size {world_size}")
    layers = moe_layers(model)
    if ep > 1 and not layers:
        raise ValueError(
            f"ep {ep} needs a model with mixture-of-experts layers (a size with a moe: section); this one has none"
        )
    for name, layer in layers:
        if layer.cfg.n_experts % ep:
            raise ValueError(f"ep {ep} does not divide the {layer.cfg.n_experts} experts of {name}")


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {getattr(layer.experts, name) for _, layer in moe_layers(model) for name in EXPERT_WEIGHTS}


def apply_expert_parallel(model: nn.Module, ep_mesh) -> str:
    """Shard every MoE layer's experts over the 1-D ``ep_mesh`` and dispatch its tokens with all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def local(param: Tensor) -> Tensor:
        return _ScaledGradient.apply(param.to_local(), 1.0 / ep_mesh.size())

    layers = moe_layers(model)
    for _, layer in layers:
        experts = layer.experts
        for name in EXPERT_WEIGHTS:
            whole = getattr(experts, name)
            setattr(
                experts,
                name,
                nn.Parameter(distribute_tensor(whole.detach(), ep_mesh, [Shard(0)]), requires_grad=whole.requires_grad),
            )
        # Called as a module (not its weights read directly), so FSDP's hooks gather the experts' shards around it.
        experts.forward = functools.partial(local_experts_forward, experts, local)
        layer.dispatch = AllToAllDispatch(ep_mesh.get_group(), ep_mesh.size())
    n_experts = layers[0][1].cfg.n_experts if layers else 0
    return f"expert parallel over {ep_mesh.size()} ranks ({n_experts // ep_mesh.size()} of {n_experts} experts per rank in {len(layers)} MoE layers)"


def apply_expert_data_parallel(
    model: nn.Module, mesh, expert_dp_dim: str, sharded: bool, config: ParallelConfig
) -> str:
    """FSDP (``sharded``) or DDP of each MoE layer's experts over ``mesh[expert_dp_dim]``, the ranks
    that hold the same experts. Done before the blocks are wrapped, which then leave these alone."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    mp_policy, offload = data_parallel_policies(config)
    expert_mesh = mesh[expert_dp_dim]
    layers = moe_layers(model)
    for _, layer in layers:
        if sharded:
            fully_shard(
                layer.experts,
                mesh=expert_mesh,
                reshard_after_forward=config.reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload,
            )
        else:
            replicate(layer.experts, mesh=expert_mesh, mp_policy=mp_policy)
    kind = "FSDP" if sharded else "DDP"
    return f"experts of {len(layers)} MoE layers: {kind} over the {expert_mesh.size()} ranks holding the same experts ({expert_dp_dim})"


def local_experts_forward(
    experts: GroupedExperts, local: Callable[[Tensor], Tensor], x: Tensor, counts: Tensor
) -> Tensor:
    """``GroupedExperts.forward`` on this rank's values of the experts' weights (``local`` of each DTensor)."""
    weights = [local(getattr(experts, name)) for name in EXPERT_WEIGHTS]
    return expert_feed_forward(
        x, counts, *weights, backend=experts.kernels.experts, swiglu_backend=experts.kernels.swiglu
    )


def apply_moe_tensor_parallel(layer: MoEFeedForward, tp_mesh) -> None:
    """A MoE layer in a sequence-parallel block: each tp rank routes its own slice of the tokens
    through the whole router, experts and shared expert (a token's route depends on that token
    alone). Their weights become replicated DTensors on the tp mesh, as every other parameter; the
    layer computes with their local values, whose gradients, each from this rank's tokens only,
    the tp ranks sum in backward."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    group = tp_mesh.get_group()
    for module in layer.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(param.detach(), tp_mesh, [Replicate()]), requires_grad=param.requires_grad
                ),
            )

    def local(param: Tensor) -> Tensor:
        return _SummedGradient.apply(param.to_local(), group)

    for linear in (m for m in layer.modules() if isinstance(m, nn.Linear)):  # the router, the shared expert
        linear.forward = functools.partial(_local_linear, linear, local)
    layer.experts.forward = functools.partial(local_experts_forward, layer.experts, local)


def _local_linear(linear: nn.Linear, local: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return F.linear(x, local(linear.weight), None if linear.bias is None else local(linear.bias))


class _SummedGradient(torch.autograd.Function):
    """Identity whose backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ScaledGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale`` (a power of two for ep a power of two: exact)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


class AllToAllDispatch:
    """A MoE layer's ``dispatch`` under expert parallelism: tokens to their experts' ranks and back."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single  # differentiable

        local_experts = counts.numel() // self.size
        # How many choices each rank sends for each of this rank's experts: [source rank, local expert].
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local_experts)
        send_splits = counts.view(self.size, local_experts).sum(1).tolist()
        receive_splits = received.sum(1).tolist()
        arrived = all_to_all_single(x, receive_splits, send_splits, self.group)
        # Arrived rows are grouped by source rank, then expert; the experts want them by expert.
        expert_of_row = (
            torch.arange(local_experts, device=x.device).repeat(self.size).repeat_interleave(received.flatten())
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = experts(arrived[by_expert], received.sum(0))
        back = torch.empty_like(out)
        back[by_expert] = out  # a permutation: each row written once
        return all_to_all_single(back, send_splits, receive_splits, self.group)
