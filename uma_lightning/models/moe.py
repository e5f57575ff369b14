"""Mixture-of-experts feed-forward: token-choice top-k routing over stacked SwiGLU experts.

Each token picks ``top_k`` of ``n_experts`` experts by router score (softmax or sigmoid) and gets
their outputs weighted by its scores renormalised over the chosen ones, plus the output of
``n_shared`` always-on experts (one dense feed-forward ``n_shared`` times as wide).

Load balancing is aux-loss-free by default: a per-expert bias, added to the scores only to choose
experts, is nudged after every optimizer step towards the experts that got fewer tokens than the
mean (``update_bias``, outside autograd; the bias is a persistent buffer, so checkpoints carry it).
The nudge is a fixed step times sign(mean - load) (``bias_update: sign``, DeepSeek-V3's), or that
step times (mean - load) / mean (``proportional``), which shrinks as the loads even out.
A bias moves every token's choice by the same amount, so tokens that are nearly alike (a camera
frame's flat background, instruction padding: about half the tokens of a tiny_moe pretraining batch)
choose alike and change expert all together: the bias cannot settle between two experts, and each
step one of them carries the whole block. ``selection_noise``, noise on the biased scores when
choosing (training only; a function of each score, see ``selection_noise``), breaks those near-ties,
so the bias splits such a block between experts in the proportion that balances them; the combine
weights stay the noise-free scores.
An optional sequence-level auxiliary loss adds ``aux_loss_weight`` times its value to the
training loss through the layer's output (see ``_AuxiliaryLoss``), so it reaches the router whatever
wraps the block.

Dropless by default. With ``capacity_factor`` each expert takes at most
ceil(capacity_factor * tokens * top_k / n_experts) tokens, in token order, and the rest of its
assignments are dropped (counted in ``stats``).

Tokens are sorted by expert and run through ``uma_lightning.kernels.expert_feed_forward``. The
combine writes each assignment's output into its own slot and sums a token's top_k slots, so it
is deterministic (no scatter-add). Expert weights keep the names ``experts.w1``, ``experts.w3``
[E, dim, hidden] and ``experts.w2`` [E, hidden, dim] however the experts are laid out over ranks.

``dispatch`` is the seam for expert parallelism: a parallel plan replaces it with one that sends
tokens to the ranks owning their experts and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from uma_lightning.kernels import KernelConfig, expert_feed_forward

ROUTER_SCORES = ("softmax", "sigmoid")
BIAS_UPDATES = ("sign", "proportional")


@dataclass(frozen=True)
class MoEConfig:
    """The ``moe:`` section of a backbone size; see the module docstring.

    Args:
        n_experts: Routed experts per MoE layer.
        top_k: Experts each token is sent to (token choice).
        n_shared: Always-on experts, run on every token (one feed-forward n_shared times as wide).
        every_n_layers: Layers i with (i + 1) % every_n_layers == 0 are MoE layers (1: all of them).
        expert_dim: Each expert's hidden size (empty: the backbone's ffn_dim).
        score: Router scores, softmax or sigmoid; the chosen experts' scores, renormalised, weight their outputs.
        bias_update_rate: Step of the balancing bias per optimizer step (0: no bias balancing).
        bias_update: sign (the step times sign(mean - load)) or proportional (times (mean - load) / mean).
        selection_noise: Std of the noise added, in training only, to the biased scores that choose experts (0: none).
        aux_loss_weight: Weight of a sequence-level balance loss added to the training loss (0: none).
        capacity_factor: At most ceil(factor x tokens x top_k / n_experts) tokens per expert, the rest
            dropped and counted; empty: dropless.
    """

    n_experts: int = 8
    top_k: int = 2
    n_shared: int = 0
    every_n_layers: int = 1
    expert_dim: Optional[int] = None
    score: str = "softmax"
    bias_update_rate: float = 1e-3
    bias_update: str = "sign"
    selection_noise: float = 0.01
    aux_loss_weight: float = 0.0
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.n_experts < 1:
            raise ValueError(f"moe.n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"moe.top_k must be between 1 and n_experts={self.n_experts}, got {self.top_k}")
        if self.n_shared < 0 or self.every_n_layers < 1:
            raise ValueError(
                f"moe.n_shared must be >= 0 and moe.every_n_layers >= 1, got {self.n_shared} and {self.every_n_layers}"
            )
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"moe.score must be one of {', '.join(ROUTER_SCORES)}, got {self.score!r}")
        if self.bias_update not in BIAS_UPDATES:
            raise ValueError(f"moe.bias_update must be one of {', '.join(BIAS_UPDATES)}, got {self.bias_update!r}")
        if min(self.bias_update_rate, self.selection_noise, self.aux_loss_weight) < 0:
            raise ValueError(
                "moe.bias_update_rate, moe.selection_noise and moe.aux_loss_weight must be >= 0, "
                f"got {self.bias_update_rate}, {self.selection_noise} and {self.aux_loss_weight}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"moe.capacity_factor must be > 0 (or empty: dropless), got {self.capacity_factor}")

    def is_moe_layer(self, index: int) -> bool:
        return (index + 1) % self.every_n_layers == 0

    def hidden(self, ffn_dim: int) -> int:
        return self.expert_dim or ffn_dim


@dataclass
class Routing:
    """Where one forward's tokens go: assignment a = token * top_k + slot."""

    chosen: Tensor  # [T, top_k] expert of each assignment
    kept: Tensor  # [T, top_k] False where the expert was full
    order: Tensor  # [kept assignments] their ids sorted by expert, in token order within one
    counts: Tensor  # [E] kept assignments per expert
    weights: Tensor  # [T, top_k] combine weights (zero where dropped)


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights; a plan may keep only a slice of them on each rank."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.kernels = KernelConfig()

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        return expert_feed_forward(
            x, counts, self.w1, self.w3, self.w2, backend=self.kernels.experts, swiglu_backend=self.kernels.swiglu
        )

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, std=std)
        nn.init.trunc_normal_(self.w3, std=std)
        nn.init.trunc_normal_(self.w2, std=out_std)


def local_dispatch(experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
    """Every expert on this process: run the sorted tokens through them."""
    return experts(x, counts)


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, cfg: MoEConfig, shared: nn.Module | None):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, dim, hidden)
        self.shared = shared
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.dispatch: Callable[[GroupedExperts, Tensor, Tensor], Tensor] = local_dispatch
        # The last forward's routing, for balancing and logging; replaced (never accumulated) by each
        # forward, so an activation-checkpointing recompute of the same tokens leaves it as it was.
        self.stats: dict[str, Tensor] = {}

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, std=std)
        self.experts.init_weights(std, out_std)
        nn.init.zeros_(self.expert_bias)

    def scores(self, tokens: Tensor) -> Tensor:
        logits = self.router(tokens).float()
        return logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()

    def route(self, scores: Tensor) -> Routing:
        top_k, n_experts = self.cfg.top_k, self.cfg.n_experts
        # The bias steers the choice only; the combine weights are the router's own scores.
        selection = scores.detach() + self.expert_bias
        if self.training and self.cfg.selection_noise:
            # Near-identical tokens (a frame's flat background, padding) would all choose alike, so the bias
            # could only move them between experts as one block and the loads would swing step to step;
            # the noise breaks their near-ties, so the bias splits such a block in proportion.
            selection = selection + self.cfg.selection_noise * selection_noise(scores.detach())
        chosen = selection.topk(top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in token order
        routed = torch.bincount(flat, minlength=n_experts)
        kept = torch.ones_like(chosen, dtype=torch.bool)
        if self.cfg.capacity_factor is not None:
            capacity = math.ceil(self.cfg.capacity_factor * scores.shape[0] * top_k / n_experts)
            starts = torch.cumsum(routed, 0) - routed
            rank_in_expert = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(routed)
            kept.view(-1)[order[rank_in_expert >= capacity]] = False
            weights = weights.masked_fill(~kept, 0.0)
            order = order[kept.view(-1)[order]]
        counts = torch.bincount(flat[order], minlength=n_experts)
        with torch.no_grad():
            probabilities = scores / scores.sum(-1, keepdim=True)
            entropy = -(probabilities * probabilities.clamp_min(1e-20).log()).sum(-1).mean()
            self.stats = {"routed": routed, "dropped": (~kept).sum(), "entropy": entropy}
        return Routing(chosen, kept, order, counts, weights)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores = self.scores(tokens)
        routing = self.route(scores)
        token_of = routing.order // self.cfg.top_k
        expert_out = self.dispatch(self.experts, tokens[token_of], routing.counts)
        slots = expert_out.new_zeros(tokens.shape[0] * self.cfg.top_k, dim)
        slots[routing.order] = expert_out  # every kept assignment has its own slot: no accumulation
        weights = routing.weights.to(expert_out.dtype)
        out = (slots.view(-1, self.cfg.top_k, dim) * weights.unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(batch, seq, dim)
        if self.cfg.aux_loss_weight and self.training and torch.is_grad_enabled():
            loss = sequence_balance_loss(scores.view(batch, seq, -1), routing, self.cfg)
            self.stats["aux_loss"] = loss.detach()
            out = _AuxiliaryLoss.apply(out, loss * self.cfg.aux_loss_weight)
        return out

    @torch.no_grad()
    def update_bias(self, routed: Tensor) -> None:
        """Nudge the bias of experts that got more than the mean number of tokens down, the others up."""
        if self.cfg.bias_update_rate:
            routed = routed.float().to(self.expert_bias.device)
            mean = routed.mean()
            if self.cfg.bias_update == "sign":
                self.expert_bias += self.cfg.bias_update_rate * torch.sign(mean - routed)
            elif mean > 0:
                self.expert_bias += self.cfg.bias_update_rate * (mean - routed) / mean


def selection_noise(scores: Tensor) -> Tensor:
    """Zero-mean, unit-variance noise, uniform, that is a function of each score alone: the fractional part
    of a large multiple of it, so tokens whose scores differ by a thousandth get unrelated values. Unlike
    a random generator's draws it is the same whichever rank, batch slice or activation-checkpointing
    recompute routes the token, so every parallel layout chooses the same experts."""
    return (torch.remainder(scores * 4099.0, 1.0) - 0.5) * math.sqrt(12.0)


def sequence_balance_loss(scores: Tensor, routing: Routing, cfg: MoEConfig) -> Tensor:
    """Per sequence, sum over experts of (its share of the sequence's kept choices, scaled so uniform
    is 1) times (its mean normalised score); averaged over sequences. 1 when balanced."""
    batch, seq, n_experts = scores.shape
    choices = F.one_hot(routing.chosen, n_experts).to(scores.dtype) * routing.kept.unsqueeze(-1)  # [T, k, E]
    fraction = choices.view(batch, seq * cfg.top_k, n_experts).sum(1) * n_experts / (cfg.top_k * seq)
    probabilities = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (fraction * probabilities).sum(-1).mean()


class _AuxiliaryLoss(torch.autograd.Function):
    """Identity on the layer's output whose backward also sends a gradient of 1 into ``loss``: the
    same gradients as adding the loss to the training loss, through the path every wrapper hooks."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoEFeedForward)]


def combined_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The ``stats`` one forward over equal-sized micro-batches would have left, from each one's:
    counts summed, means (entropy, the sequence loss) averaged."""
    combined = {key: torch.stack([part[key] for part in parts]).sum(0) for key in ("routed", "dropped")}
    for key in ("entropy", "aux_loss"):
        if key in parts[0]:
            combined[key] = torch.stack([part[key] for part in parts]).mean(0)
    return combined


class ExpertBalancing:
    """The aux-loss-free balancing of a model's MoE layers over training steps: ``record`` after each
    micro-batch's backward (after it, so an activation-checkpointing recompute, which routes the same
    tokens again, is not counted twice), ``update`` after each optimizer step with the function that
    sums each layer's counts over the ranks that hold the layer (so they all move its bias the same way)."""

    def __init__(self) -> None:
        self.routed: dict[str, Tensor] = {}  # per MoE layer name: choices per expert since the last update

    def record(self, model: nn.Module) -> None:
        for name, layer in moe_layers(model):
            if "routed" in layer.stats:
                self.routed[name] = (
                    layer.stats["routed"] + self.routed[name] if name in self.routed else layer.stats["routed"]
                )

    def update(self, model: nn.Module, sum_over_ranks: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> None:
        """``sum_over_ranks`` runs on every rank, also one whose layers (none, on some pipeline stages) recorded nothing."""
        summed = sum_over_ranks(self.routed)
        for name, layer in moe_layers(model):
            if name in summed:
                layer.update_bias(summed[name])
        self.routed = {}
