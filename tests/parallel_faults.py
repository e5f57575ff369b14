"""Modules with parallelism bugs, to check that `uma parity` catches and locates each."""

import functools

import torch
import torch.nn.functional as F

from uma_lightning.models import RobotTransformer
from uma_lightning.modules import PretrainModule
from uma_lightning.parallel import register_plan
from uma_lightning.parallel.pipeline import pipeline_of
from uma_lightning.parallel.plans.experts import local_experts_forward
from uma_lightning.parallel.plans.pipeline import check_pipeline, pipeline_robot
from uma_lightning.parallel.plans.registry import PipelineSplit
from uma_lightning.parallel.plans.robot import check_robot, parallelize_robot


class TokenMeanPretrain(PretrainModule):
    """Averages the loss over the batch's real tokens. Data-parallel ranks average their losses
    with equal weights, so when their slices hold different numbers of real tokens (samples near
    an episode's end), the gradient differs from that of one process on the whole batch."""

    def compute_loss(self, batch):
        model = self.model
        text_ids, text_mask = model.text_tokenizer(batch["instruction"])
        targets = model.action_binner.encode(batch["actions"]).flatten(1)
        logits = model(batch["images"], batch["state"], text_ids, text_mask, targets)
        real = batch["action_mask"].repeat_interleave(self.spec.action_dim, dim=1)
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        return {"loss": (losses * real).sum() / real.sum()}


# ---- bugs a parallel plan or a training step can have, injected one at a time ------------------------
# Each is a test-only hook or plan: production code is not touched. On one process every fault is
# inactive, so the references train as PretrainModule does.


class FaultyRobot(RobotTransformer):
    """The robot model under a test-only plan: the robot plan with the bug named by ``fault``."""

    fault = "none"


class InjectedFault(PretrainModule):
    """PretrainModule with one parallelism bug (``fault``) when it runs on more than one process:

    - ``unreduced_gradient``: the gradient of ``UNREDUCED`` is each rank's own, not all-reduced;
    - ``rank_seed``: rank 1 initialises the model from another seed;
    - ``wrong_group``: (plan) HSDP averages gradients over the shard group only, not across replicas;
    - ``wrong_dim``: (plan) block 0's query weight is split over head_dim instead of over heads;
    - ``unreduced_norm``: (plan) block 0's sequence-parallel feed-forward norm computes on local
      tokens and leaves its weight gradient unreduced;
    - ``unscaled_microbatches``: (pipeline) gradients are summed over the microbatches, not averaged
      (the schedule's division by their number left out);
    - ``wrong_rank``: (plan) block 0's mixture-of-experts layer sends the tokens meant for each ep
      rank's experts to the next rank, whose experts at the same local index compute them;
    - ``unsummed_experts``: (plan) under tp, block 0's mixture-of-experts layer leaves its experts'
      gradients each rank's own (from its slice of the tokens), not summed over the tp ranks.
    """

    UNREDUCED = "model.backbone.layers.0.ffn.w2.weight"

    def __init__(self, fault: str = "none", **kwargs):
        super().__init__(**kwargs)
        self.fault = fault
        self._local_grad: torch.Tensor | None = None

    def build_model(self):
        model = super().build_model()
        model.__class__ = FaultyRobot
        model.fault = self.fault
        return model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.fault == "rank_seed" and self.trainer.world_size > 1 and self.global_rank == 1:
            torch.manual_seed(1)
        super().configure_model()
        if self.fault == "unreduced_gradient":
            # Its pre-hook runs after FSDP's (registered on the block, around it): the weight it sees is the unsharded one.
            self.model.get_submodule(
                self.UNREDUCED.removeprefix("model.").removesuffix(".weight")
            ).register_forward_pre_hook(self._keep_local_grad)

    def _keep_local_grad(self, linear, args):
        if linear.weight.requires_grad:
            linear.weight.register_hook(self._store_local_grad)

    def _store_local_grad(self, grad):
        self._local_grad = grad.detach().clone()

    def on_after_backward(self) -> None:
        pipeline = pipeline_of(self)
        if self.fault == "unscaled_microbatches" and pipeline is not None:
            for param in self.parameters():
                if param.grad is not None:
                    (param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad).mul_(
                        pipeline.microbatches
                    )
        if self.fault == "unreduced_gradient" and self.trainer.world_size > 1:
            param = self.get_parameter(self.UNREDUCED)
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad.copy_(self._local_grad)


class _ShardGroupOnly:
    """A mesh whose (dp_replicate, dp_shard) sub-mesh is the dp_shard one: the plan's FSDP then reduces within replicas only."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __getitem__(self, dims):
        return self.mesh["dp_shard"] if dims == ("dp_replicate", "dp_shard") else self.mesh[dims]

    @property
    def mesh_dim_names(self):
        return self.mesh.mesh_dim_names


class _ToNextRank:
    """A MoE layer's expert-parallel dispatch with the bug: each rank's block of tokens goes to the
    rank after the one owning their experts, and the outputs come back in the right place."""

    def __init__(self, dispatch):
        self.dispatch = dispatch

    def __call__(self, experts, x, counts):
        per_rank = counts.view(self.dispatch.size, -1)
        blocks = x.split(per_rank.sum(1).tolist())
        moved = per_rank.roll(1, 0)  # row r now holds what was meant for rank r - 1
        out = self.dispatch(experts, torch.cat(blocks[-1:] + blocks[:-1]), moved.flatten())
        back = out.split(moved.sum(1).tolist())
        return torch.cat(back[1:] + back[:1])


def _parallelize_with_fault(model: FaultyRobot, mesh, config):
    from torch.distributed.tensor import DTensor

    applied = parallelize_robot(model, _ShardGroupOnly(mesh) if model.fault == "wrong_group" else mesh, config)
    block = model.backbone.layers[0]
    if model.fault == "wrong_dim":
        weight = block.attn.wq.weight
        heads, tp = model.cfg.backbone.n_heads, mesh["tp"].size()
        full = weight.full_tensor().view(heads, -1, weight.shape[-1])
        wrong = full.chunk(tp, dim=1)[mesh["tp"].get_local_rank()].reshape(-1, weight.shape[-1])
        with torch.no_grad():
            weight.to_local().copy_(wrong)
    if model.fault == "unreduced_norm":
        norm = block.ffn_norm

        def local_norm(x):
            weight = norm.weight.to_local()  # its gradient comes back as this rank's tokens' part only
            out = F.rms_norm(x.to_local(), (x.shape[-1],), weight, norm.eps)
            return DTensor.from_local(out, x.device_mesh, x.placements)

        norm.forward = local_norm
    if model.fault == "wrong_rank":
        block.ffn.dispatch = _ToNextRank(block.ffn.dispatch)
    if model.fault == "unsummed_experts":
        block.ffn.experts.forward = functools.partial(
            local_experts_forward, block.ffn.experts, lambda param: param.to_local()
        )
    return applied


# The robot family's own pipeline split: the pipeline faults are injected in the module, not the plan.
register_plan(
    FaultyRobot,
    _parallelize_with_fault,
    check_robot,
    name="robot with an injected fault",
    pipeline=PipelineSplit(check_pipeline, pipeline_robot),
)


class OverflowingPretrain(PretrainModule):
    """PretrainModule whose block 0 feed-forward input projection multiplies its input by 1e5 and
    divides its output by as much: the same function in fp32 (and within bf16's range), but
    beyond fp16's largest number (65504), so under 16-mixed that layer's output is infinite."""

    OVERFLOWING = "model.backbone.layers.0.ffn.w1"

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        linear = self.get_submodule(self.OVERFLOWING)
        forward = linear.forward
        linear.forward = lambda x: forward(x * 1e5) / 1e5
