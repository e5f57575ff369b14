"""The robot transformer with a continuous action expert trained by flow matching, as in pi0.

The observation prefix (instruction, camera patches, state) goes through the pretrained backbone
once. The action expert is a second, narrower transformer with one layer per backbone layer; its
tokens are the noisy action chunk (one token per step, with the flow time mixed in), and each of
its layers attends to its own keys and values and to the backbone's keys and values of the prefix
at the same depth:

    backbone layer l:   prefix tokens  -> keys/values of the prefix (cached)
    expert layer l:     action tokens  -> attend to [cached prefix | action tokens]

The prefix never attends to the actions, so at inference its cache is computed once and every
Euler step of the sampler reuses it. Training takes the same path with one noisy chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from uma_lightning.models.flow_matching import euler_sample, time_embedding
from uma_lightning.models.robot import RobotBase, RobotModelConfig
from uma_lightning.models.transformer import KVCache, Transformer, TransformerConfig


@dataclass(frozen=True)
class ActionExpertConfig:
    """Width of the action expert; its depth, key/value heads and head size are the backbone's,
    because each expert layer attends to the keys and values of a backbone layer.

    Args:
        dim: Width; None: the backbone's. A multiple of the backbone's head size.
        ffn_dim: Hidden size of its feed-forwards; None: the backbone's.
    """

    dim: Optional[int] = None
    ffn_dim: Optional[int] = None

    def transformer_config(self, backbone: TransformerConfig) -> TransformerConfig:
        dim = self.dim or backbone.dim
        head_dim = backbone.head_dim
        if dim % head_dim or (dim // head_dim) % backbone.n_kv_heads:
            raise ValueError(
                f"action expert dim {dim} must be a multiple of head size {head_dim} times the backbone's "
                f"{backbone.n_kv_heads} key/value heads"
            )
        return TransformerConfig(
            dim=dim,
            n_layers=backbone.n_layers,
            n_heads=dim // head_dim,
            n_kv_heads=backbone.n_kv_heads,
            ffn_dim=self.ffn_dim or backbone.ffn_dim,
            norm_eps=backbone.norm_eps,
            rope_theta=backbone.rope_theta,
            name="action_expert",
        )


class TimeEmbedding(nn.Module):
    """Sine-cosine features [B, width] of flow times [B] (``flow_matching.time_embedding``). A module of
    its own so a parallel plan can set the layouts of its input and output."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return time_embedding(t, self.width)


class ActionExpert:
    """pi0's action expert over a prefix cache, shared by the flow models: the noisy chunk's tokens
    (one per step, the flow time mixed in), a transformer of ``expert_config`` attending to a prefix
    cache, and the velocity out. A mixin of ``nn.Module``s: its parameter names are the same in each."""

    def build_action_expert(self, expert_config: TransformerConfig, action_dim: int, max_seq_len: int) -> None:
        self.expert_config = expert_config
        width = expert_config.dim
        self.action_in = nn.Linear(action_dim, width)
        self.time_embed = TimeEmbedding(width)
        # Mixes each noisy action with the flow time (pi0's action-time MLP).
        self.action_time_mlp = nn.Sequential(nn.Linear(2 * width, width), nn.SiLU(), nn.Linear(width, width))
        self.expert = Transformer(expert_config, max_seq_len=max_seq_len)
        self.action_out = nn.Linear(width, action_dim)

    def init_action_expert(self) -> None:
        for module in (self.action_in, self.action_time_mlp[0], self.action_time_mlp[2], self.action_out):
            module.reset_parameters()
        self.expert.init_weights()

    def velocity(self, prefix_cache: KVCache, noisy_actions: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted velocity [B, horizon, action_dim] of noisy chunks [B, horizon, action_dim] at times t [B].
        The prefix cache is read, not extended."""
        actions = self.action_in(noisy_actions)
        times = self.time_embed(t).to(actions.dtype)[:, None].expand_as(actions)
        tokens = self.action_time_mlp(torch.cat((actions, times), dim=-1))
        # Every action token is real. Given, not derived from the expert's input, which a
        # sequence-parallel plan splits across ranks.
        real = torch.ones(noisy_actions.shape[:2], dtype=torch.bool, device=noisy_actions.device)
        return self.action_out(self.expert(tokens, key_padding_mask=real, cache=prefix_cache.copy()))

    def sample_actions(
        self, cache: KVCache, state: torch.Tensor, steps: int, noise: torch.Tensor | None, noise_scale: float
    ) -> torch.Tensor:
        """Normalised action chunk [B, horizon, action_dim]: ``steps`` Euler steps from noise (standard
        normal times ``noise_scale`` unless given; of ``state``'s batch, device and dtype), all reading
        one cache of the prefix."""
        spec = self.cfg.spec
        if noise is None:
            shape = (state.shape[0], spec.action_horizon, spec.action_dim)
            noise = noise_scale * torch.randn(shape, device=state.device, dtype=state.dtype)
        return euler_sample(lambda x, t: self.velocity(cache, x, t), noise, steps)


class RobotFlowTransformer(ActionExpert, RobotBase):
    def __init__(self, cfg: RobotModelConfig, expert: ActionExpertConfig | None = None):
        super().__init__(cfg, max_seq_len=cfg.prefix_len)
        self.build_action_expert(
            (expert or ActionExpertConfig()).transformer_config(cfg.backbone),
            cfg.spec.action_dim,
            max_seq_len=cfg.prefix_len + cfg.spec.action_horizon,
        )
        self.init_weights()
        self.freeze_what_gets_no_gradient()

    @property
    def tokens_per_sample(self) -> int:
        """Tokens per sample: the backbone's prefix and the expert's action chunk."""
        return self.cfg.prefix_len + self.cfg.spec.action_horizon

    def set_kernels(self, kernels) -> None:
        super().set_kernels(kernels)
        self.expert.set_kernels(kernels)

    def init_weights(self) -> None:
        super().init_weights()
        self.init_action_expert()

    def freeze_what_gets_no_gradient(self) -> None:
        """The action expert reads only the prefix's keys and values, not its final hidden states: without
        an environment-state head (which reads them) the last backbone block's query and output
        projections, its feed-forward and the final norm (LoRA adapters on them too) feed nothing that
        is trained. Frozen, data-parallel wrappers do not wait for their gradients, and the optimizer
        holds state for every parameter it trains, so a resumed run loads exactly that state."""
        if self.cfg.environment_state_head:
            return
        last = self.backbone.layers[-1]
        for module in (last.attn.wq, last.attn.wo, last.ffn_norm, last.ffn, self.backbone.norm):
            module.requires_grad_(False)

    def forward(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        text_ids: torch.Tensor,
        text_mask: torch.Tensor,
        noisy_actions: torch.Tensor,
        t: torch.Tensor,
        *,
        with_environment_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Predicted velocity [B, horizon, action_dim] (the training path); ``with_environment_state``
        returns (velocity, the predicted environment state [B, dim])."""
        hidden, cache = self.encode_prefix(images, state, text_ids, text_mask)
        velocity = self.velocity(cache, noisy_actions, t)
        return (velocity, self.predict_environment_state(hidden[:, -1])) if with_environment_state else velocity

    def predict_actions(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        text_ids: torch.Tensor,
        text_mask: torch.Tensor,
        steps: int = 10,
        noise: torch.Tensor | None = None,
        noise_scale: float = 1.0,
    ) -> torch.Tensor:
        """Normalised action chunk [B, horizon, action_dim]: ``steps`` Euler steps from noise (standard
        normal times ``noise_scale`` unless given), all reading one cache of the prefix."""
        _, cache = self.encode_prefix(images, state, text_ids, text_mask)
        return self.sample_actions(cache, state, steps, noise, noise_scale)
