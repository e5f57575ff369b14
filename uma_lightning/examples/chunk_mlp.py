"""A network of your own, as the "Bring your own network" tutorial writes it: plain PyTorch, no plan.

``ChunkMLP`` regresses the whole action chunk from the observation steps (the state and each
camera's mean colour) through residual MLP blocks; ``ChunkMLPPretrain`` trains it with the masked
mean squared error of the chunk. ``uma fit --model uma_lightning.examples.chunk_mlp.ChunkMLPPretrain``
selects it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.models.tokenizers import ByteTokenizer
from uma_lightning.modules import PretrainModule


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ChunkMLP(nn.Module):
    def __init__(self, spec: DataSpec, width: int = 64, depth: int = 2):
        super().__init__()
        self.horizon, self.action_dim = spec.action_horizon, spec.action_dim
        # Policy tokenises the instruction with it; this network does not read the instruction.
        self.text_tokenizer = ByteTokenizer(16)
        inputs = spec.n_obs_steps * (spec.state_dim + 3 * len(spec.cameras))
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, self.horizon * self.action_dim)

    def forward(self, images: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Normalised action chunks, flat [B, horizon * action_dim], from images [B, T, cameras, H, W, 3]
        uint8 and normalised state [B, T, state_dim]. Flat, not a view of them: FSDP warns of a
        wrapped module that returns a view."""
        dtype = self.embed.weight.dtype  # the parameters' dtype: float64 under uma parity
        colours = images.to(dtype).mean(dim=(3, 4)).flatten(2) / 255  # [B, T, cameras * 3]
        x = self.embed(torch.cat([state.to(dtype), colours], dim=-1).flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def predict_actions(self, images, state, text_ids, text_mask):
        """What validation and Policy call: normalised action chunks [B, horizon, action_dim]."""
        return self(images, state).view(-1, self.horizon, self.action_dim)


class ChunkMLPPretrain(PretrainModule):
    key_metric = "val/action_mse"

    def __init__(self, width: int = 64, depth: int = 2, **kwargs):
        """
        Args:
            width: Features of the residual blocks.
            depth: Residual blocks.
            **kwargs: ``StageModule``'s: spec, network, optimizer, init_from, normalization.
        """
        super().__init__(**kwargs)
        self.width, self.depth = width, depth

    def build_model(self) -> ChunkMLP:
        return ChunkMLP(self.spec, self.width, self.depth)

    def compute_loss(self, batch: dict) -> dict[str, torch.Tensor]:
        """Each sample's mean squared error over its real chunk steps, averaged over the samples (so
        data-parallel ranks, which average their gradients, train as one process on the whole batch)."""
        predicted = self.model(batch["images"], batch["state"]).view_as(batch["actions"])
        real = batch["action_mask"][..., None].to(predicted.dtype)  # [B, horizon, 1]
        error = (predicted - batch["actions"].to(predicted.dtype)).square() * real
        per_sample = error.sum((1, 2)) / (real.sum((1, 2)) * predicted.shape[-1]).clamp(min=1)
        return {"loss": per_sample.mean()}
