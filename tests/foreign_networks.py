"""Networks unlike ours, written as a researcher would: plain PyTorch, no parallel plan, each with
the stage module that trains it (``PretrainModule`` with its own ``build_model`` and ``compute_loss``).

- ``DenoiserMLP``: a diffusion-style denoiser: residual MLP blocks predict the noise added to an
  action chunk, given the state and the noise level; it declares a tensor-parallel layout as data;
- ``MixtureOfMLPs``: a softly gated mixture of small MLP experts that maps an observation to actions;
- ``TemporalConvPolicy``: causal 1-D convolutions over the observation steps, with Hugging Face's
  ``_no_split_modules`` naming its blocks.

They read the batch as the data module gives it (images uint8, state, actions) and cast only to
their parameters' dtype, so they run in any precision, float64 (``uma parity``) included. Each has
what evaluation and ``Policy`` call (``models/contract.py``): ``predict_actions`` and a
``text_tokenizer`` (none of them reads the instruction).
``ForeignPretrain(skip_gradient=NAME)`` seeds a bug: with more than one process, the gradient of
parameter NAME is dropped after the backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from uma_lightning.models.tokenizers import ByteTokenizer
from uma_lightning.modules import PretrainModule

INSTRUCTION_BYTES = 8  # tokenised for Policy's sake; these networks do not read the instruction


def image_features(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, cameras * 3]: each camera's mean colour per observation step, in [0, 1]."""
    return images.to(dtype).mean(dim=(3, 4)).flatten(2) / 255


def observation_steps(images: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """[B, T, state_dim + cameras * 3]: the state and the cameras' mean colours of each step."""
    return torch.cat([state, image_features(images, state.dtype)], dim=-1)


class ResidualMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DenoiserMLP(nn.Module):
    # Megatron's MLP split: fc1's outputs over the ranks, fc2 sums their parts.
    tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self, state_dim: int, chunk: int, width: int = 32, depth: int = 3, action_dim: int = 1):
        super().__init__()
        self.action_dim = action_dim
        self.text_tokenizer = ByteTokenizer(INSTRUCTION_BYTES)
        self.embed = nn.Linear(state_dim + chunk + 1, width)
        self.blocks = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.out = nn.Linear(width, chunk)

    def forward(self, state, noisy_chunk, noise_level):
        x = self.embed(torch.cat([state.flatten(1), noisy_chunk, noise_level[:, None]], dim=1))
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def predict_actions(self, images, state, text_ids, text_mask, levels=(0.9, 0.5, 0.1)):
        """Deterministic denoising from the noise's mean: at each level, the clean chunk the predicted
        noise implies, noised again to the next level with that same noise."""
        chunk = torch.zeros(state.shape[0], self.out.out_features, dtype=state.dtype, device=state.device)
        for level, following in zip(levels, (*levels[1:], 0.0)):
            noise = self(state, chunk, torch.full_like(chunk[:, 0], level))
            clean = (chunk - level**0.5 * noise) / (1 - level) ** 0.5
            chunk = (1 - following) ** 0.5 * clean + following**0.5 * noise
        return chunk.view(state.shape[0], -1, self.action_dim)


class MixtureOfMLPs(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, n_experts: int = 4, hidden: int = 16, action_dim: int = 1):
        super().__init__()
        self.action_dim = action_dim
        self.text_tokenizer = ByteTokenizer(INSTRUCTION_BYTES)
        self.gate = nn.Linear(in_dim, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim)) for _ in range(n_experts)
        )

    def forward(self, x):
        weights = self.gate(x).softmax(-1)  # [B, n_experts]
        outputs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, n_experts, out_dim]
        return (weights[..., None] * outputs).sum(1)

    def predict_actions(self, images, state, text_ids, text_mask):
        return self(observation_steps(images, state).flatten(1)).view(state.shape[0], -1, self.action_dim)


class TemporalBlock(nn.Module):
    def __init__(self, channels: int, kernel: int = 2):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, padding=kernel - 1)
        self.mix = nn.Conv1d(channels, channels, 1)

    def forward(self, x):  # [B, channels, T]
        return x + self.mix(F.gelu(self.conv(x)[..., : x.shape[-1]]))  # causal: step t sees steps <= t


class TemporalConvPolicy(nn.Module):
    _no_split_modules = ["TemporalBlock"]

    def __init__(self, in_dim: int, out_dim: int, channels: int = 16, depth: int = 2, action_dim: int = 1):
        super().__init__()
        self.action_dim = action_dim
        self.text_tokenizer = ByteTokenizer(INSTRUCTION_BYTES)
        self.inp = nn.Linear(in_dim, channels)
        self.blocks = nn.Sequential(*(TemporalBlock(channels) for _ in range(depth)))
        self.head = nn.Linear(channels, out_dim)

    def forward(self, steps):  # [B, T, in_dim]
        h = self.blocks(self.inp(steps).transpose(1, 2))
        return self.head(h[..., -1])

    def predict_actions(self, images, state, text_ids, text_mask):
        return self(observation_steps(images, state)).view(state.shape[0], -1, self.action_dim)


# ---- the stage modules that train them ------------------------------------------------------------


class ForeignPretrain(PretrainModule):
    """What the three share: the chunk's masked mean squared error, and the seeded bug."""

    def __init__(self, skip_gradient: Optional[str] = None, **kwargs):
        super().__init__(**kwargs)
        self.skip_gradient = skip_gradient

    def chunk_loss(self, predicted: torch.Tensor, target: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch["action_mask"].to(predicted.dtype)[..., None]  # [B, horizon, 1]
        error = (predicted.view_as(target) - target).square() * mask
        return (error.sum((1, 2)) / (mask.sum((1, 2)) * target.shape[-1]).clamp(min=1)).mean()

    def on_after_backward(self) -> None:
        super().on_after_backward()
        if self.skip_gradient and self.trainer.world_size > 1:
            grad = self.get_parameter(self.skip_gradient).grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).zero_()


class DenoiserPretrain(ForeignPretrain):
    def build_model(self):
        spec = self.spec
        chunk = spec.action_horizon * spec.action_dim
        return DenoiserMLP(spec.n_obs_steps * spec.state_dim, chunk, action_dim=spec.action_dim)

    def compute_loss(self, batch):
        actions = batch["actions"].flatten(1)
        # Noise and noise level drawn per sample from its id: the same however the batch is split.
        draws = [torch.Generator().manual_seed(int(i)) for i in batch["sample_id"]]
        noise = torch.stack([torch.randn(actions.shape[1], generator=g) for g in draws]).to(actions)
        level = torch.stack([torch.rand((), generator=g) for g in draws]).to(actions)
        noisy = (1 - level)[:, None].sqrt() * actions + level[:, None].sqrt() * noise
        predicted = self.model(batch["state"], noisy, level)
        return {"loss": self.chunk_loss(predicted, noise.view_as(batch["actions"]), batch)}


class MixturePretrain(ForeignPretrain):
    def build_model(self):
        spec = self.spec
        features = spec.n_obs_steps * (spec.state_dim + 3 * len(spec.cameras))
        return MixtureOfMLPs(features, spec.action_horizon * spec.action_dim, action_dim=spec.action_dim)

    def compute_loss(self, batch):
        x = observation_steps(batch["images"], batch["state"]).flatten(1)
        return {"loss": self.chunk_loss(self.model(x), batch["actions"], batch)}


class TemporalConvPretrain(ForeignPretrain):
    def build_model(self):
        spec = self.spec
        chunk = spec.action_horizon * spec.action_dim
        return TemporalConvPolicy(spec.state_dim + 3 * len(spec.cameras), chunk, action_dim=spec.action_dim)

    def compute_loss(self, batch):
        steps = observation_steps(batch["images"], batch["state"])
        return {"loss": self.chunk_loss(self.model(steps), batch["actions"], batch)}


class FloatCastingPretrain(MixturePretrain):
    """As ``MixturePretrain``, with the images cast by ``.float()``: it cannot run in float64."""

    def compute_loss(self, batch):
        state = batch["state"]
        x = torch.cat([state.float(), image_features(batch["images"], torch.float32)], dim=-1).flatten(1)
        return {"loss": self.chunk_loss(self.model(x), batch["actions"], batch)}
