"""The multimodal robot transformer: modality tokenizers around the backbone, and an action-bin head.

Token layout of one sample (the prefix attends bidirectionally, actions causally):

    [ instruction bytes | obs step 1: camera tokens..., state | ... | obs step T | action tokens ]
    '------------------------------- prefix --------------------------------------'

Actions are flattened to horizon x action_dim tokens (one per dimension per step, as RT-2 and
pi0-FAST do) and predicted by next-token prediction: the hidden state at position i predicts
action token i+1, so the last prefix token predicts the first action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig, linear_cross_entropy
from uma_lightning.models.tokenizers import ActionBinner, ByteTokenizer, VisionConfig, build_image_tokenizer
from uma_lightning.models.transformer import KVCache, Transformer, TransformerConfig


@dataclass(frozen=True)
class RobotModelConfig:
    backbone: TransformerConfig
    spec: DataSpec
    vision: VisionConfig = field(default_factory=VisionConfig)
    max_text_len: int = 32
    n_action_bins: int = 256
    # A linear head on the last prefix token that predicts the data's environment state (see
    # spec.py): an auxiliary target that teaches the vision pathway to locate what the task names.
    environment_state_head: bool = False

    def __post_init__(self) -> None:
        if self.environment_state_head and not self.spec.environment_state_dim:
            raise ValueError(
                "environment_state_head needs data that records an environment state (spec.environment_state_dim is 0)"
            )

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image(self.spec.image_size)

    @property
    def tokens_per_obs_step(self) -> int:
        return len(self.spec.cameras) * self.tokens_per_image + 1  # + the state token

    @property
    def prefix_len(self) -> int:
        return self.max_text_len + self.spec.n_obs_steps * self.tokens_per_obs_step

    @property
    def n_action_tokens(self) -> int:
        return self.spec.action_horizon * self.spec.action_dim

    @property
    def seq_len(self) -> int:
        """Tokens fed to the backbone: the prefix and every action token but the last."""
        return self.prefix_len + self.n_action_tokens - 1


class InstructionPooling(nn.Module):
    """The mean embedding of an instruction's real bytes: [B, L, dim] and mask [B, L] -> [B, dim].
    A module of its own so a parallel plan can set the layouts of its inputs."""

    def forward(self, text: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        weights = text_mask.unsqueeze(-1).to(text.dtype)
        return (text * weights).sum(1) / weights.sum(1).clamp(min=1)


class LinearCrossEntropy(nn.Module):
    """The fused head matmul and cross-entropy (``kernels.linear_cross_entropy``, per-sample mean) of
    hidden states [B, n, dim] and a head's weight [bins, dim]. A module of its own, so a parallel plan
    can set the layouts of its inputs: the kernel takes whole, plain tensors."""

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, backend: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(hidden, weight, targets, backend=backend, per_sample=True)


def embed_action_tokens(
    action_embed: nn.Embedding, action_dim_embed: nn.Embedding, action_tokens: torch.Tensor, start: int = 0
) -> torch.Tensor:
    """[B, n, dim]: each action-bin id's embedding plus that of its action dimension (token positions
    start.. of the flattened chunk, one dimension after another)."""
    positions = torch.arange(start, start + action_tokens.shape[1], device=action_tokens.device)
    return action_embed(action_tokens) + action_dim_embed(positions % action_dim_embed.num_embeddings)


class RobotBase(nn.Module):
    """The modality tokenizers and the backbone every robot model shares; subclasses add an action head.

    Parameter names are the same in every subclass, so a later training stage loads an earlier
    stage's tokenizers and backbone by name.
    """

    def __init__(self, cfg: RobotModelConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        dim, spec = cfg.backbone.dim, cfg.spec
        self.text_tokenizer = ByteTokenizer(cfg.max_text_len)
        self.text_embed = nn.Embedding(ByteTokenizer.vocab_size, dim)
        self.image_tokenizer = build_image_tokenizer(cfg.vision, spec.image_size, dim)
        self.instruction_pooling = (
            InstructionPooling() if cfg.vision.film else None
        )  # what conditions the image tokenizer
        self.camera_embed = nn.Embedding(len(spec.cameras), dim)
        self.state_proj = nn.Linear(spec.state_dim, dim)
        self.backbone = Transformer(cfg.backbone, max_seq_len=max_seq_len)
        self.environment_state_head = nn.Linear(dim, spec.environment_state_dim) if cfg.environment_state_head else None
        self.kernels = KernelConfig()

    def set_kernels(self, kernels: KernelConfig) -> None:
        """Use these op implementations (attention, norms, rotary, SwiGLU, the loss) from the next forward on."""
        self.kernels = kernels
        self.backbone.set_kernels(kernels)

    def init_weights(self) -> None:
        for embedding in (self.text_embed, self.camera_embed):
            nn.init.normal_(embedding.weight, std=0.02)
        self.image_tokenizer.reset_parameters()
        self.state_proj.reset_parameters()
        self.backbone.init_weights()
        if self.environment_state_head is not None:
            self.environment_state_head.reset_parameters()

    def embed_prefix(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """[B, prefix_len, dim] from images [B, T, C, H, W, 3] uint8, state [B, T, state_dim], text ids and mask [B, L]."""
        batch, steps, cameras = images.shape[:3]
        text = self.text_embed(text_ids)
        instruction = None
        if self.instruction_pooling is not None:
            instruction = self.instruction_pooling(text, text_mask).repeat_interleave(
                steps * cameras, dim=0
            )  # once per image
        camera = self.image_tokenizer(images.flatten(0, 2), instruction)  # [B*T*C, tokens per image, dim]
        camera = camera.view(batch, steps, cameras, -1, camera.shape[-1])
        camera = camera + self.camera_embed.weight[None, None, :, None, :]
        obs = torch.cat((camera.flatten(2, 3), self.state_proj(state).unsqueeze(2)), dim=2)
        return torch.cat((text, obs.flatten(1, 2)), dim=1)

    def prefix_padding_mask(self, text_mask: torch.Tensor) -> torch.Tensor:
        """[B, prefix_len], True on real tokens: every token but the instruction's padding bytes."""
        obs = torch.ones(
            text_mask.shape[0], self.cfg.prefix_len - text_mask.shape[1], dtype=torch.bool, device=text_mask.device
        )
        return torch.cat((text_mask, obs), dim=1)

    def predict_environment_state(self, last_prefix_hidden: torch.Tensor) -> torch.Tensor:
        """[B, environment_state_dim] from the final hidden state [B, dim] of the last prefix token."""
        if self.environment_state_head is None:
            raise ValueError(
                "this model has no environment-state head: build it with RobotModelConfig(environment_state_head=True)"
            )
        return self.environment_state_head(last_prefix_hidden)

    def encode_prefix(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> tuple[torch.Tensor, KVCache]:
        """Hidden states [B, prefix_len, dim] of the bidirectional prefix, and the cache of its keys and values."""
        prefix = self.embed_prefix(images, state, text_ids, text_mask)
        cache = KVCache.empty(self.cfg.backbone.n_layers)
        hidden = self.backbone(
            prefix, prefix_len=prefix.shape[1], key_padding_mask=self.prefix_padding_mask(text_mask), cache=cache
        )
        return hidden, cache


class RobotTransformer(RobotBase):
    """Discretised action tokens predicted by the backbone itself, one token per action dimension per step."""

    def __init__(self, cfg: RobotModelConfig):
        super().__init__(cfg, max_seq_len=cfg.seq_len)
        dim = cfg.backbone.dim
        self.action_binner = ActionBinner(cfg.n_action_bins)
        self.action_embed = nn.Embedding(cfg.n_action_bins, dim)
        self.action_dim_embed = nn.Embedding(cfg.spec.action_dim, dim)
        self.action_head = nn.Linear(dim, cfg.n_action_bins, bias=False)
        self.action_loss = LinearCrossEntropy()
        self.init_weights()

    @property
    def tokens_per_sample(self) -> int:
        """Tokens through the backbone per sample (throughput's tokens per second)."""
        return self.cfg.seq_len

    def init_weights(self) -> None:
        super().init_weights()
        for embedding in (self.action_embed, self.action_dim_embed):
            nn.init.normal_(embedding.weight, std=0.02)
        nn.init.normal_(self.action_head.weight, std=0.02)

    def embed_actions(self, action_tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """[B, n, dim] from flattened action-bin ids [B, n] at token positions start.. of the chunk;
        the dimension index is added per token."""
        return embed_action_tokens(self.action_embed, self.action_dim_embed, action_tokens, start)

    def forward(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        text_ids: torch.Tensor,
        text_mask: torch.Tensor,
        action_tokens: torch.Tensor,
        *,
        loss_targets: torch.Tensor | None = None,
        with_environment_state: bool = False,
    ) -> Any:
        """Logits [B, n_action_tokens, n_bins] for every action token, given all previous ones.

        With ``loss_targets`` (bin ids [B, n_action_tokens], -100 where a token does not count) it
        returns (cross-entropy, argmax predictions) instead, from the fused linear +
        cross-entropy kernel, which never holds all the logits. The loss is the mean over samples of
        each sample's token mean, so data-parallel shards average to the whole batch's loss. Inside ``forward``, so wrappers
        that hook it (FSDP, DDP) see the head's weight used.

        ``with_environment_state`` returns (that output, the predicted environment state [B, dim]).
        """
        h = self.embed_sequence(images, state, text_ids, text_mask, action_tokens)
        hidden = self.backbone(
            h, prefix_len=self.cfg.prefix_len, key_padding_mask=self.sequence_padding_mask(text_mask)
        )
        hidden = self.action_states(hidden)
        if loss_targets is None:
            out = self.action_head(hidden)
        else:
            out = self.action_loss_of(hidden, loss_targets)
        return (out, self.predict_environment_state(hidden[:, 0])) if with_environment_state else out

    # The steps of forward, each usable on its own (a pipeline stage runs some of them).

    def embed_sequence(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        text_ids: torch.Tensor,
        text_mask: torch.Tensor,
        action_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """The backbone's input [B, seq_len, dim]: the prefix, then every action token but the last."""
        return torch.cat(
            (self.embed_prefix(images, state, text_ids, text_mask), self.embed_actions(action_tokens[:, :-1])), dim=1
        )

    def sequence_padding_mask(self, text_mask: torch.Tensor) -> torch.Tensor:
        """[B, seq_len], True on real tokens: every token but the instruction's padding bytes."""
        real = torch.ones(
            text_mask.shape[0], self.cfg.seq_len - text_mask.shape[1], dtype=torch.bool, device=text_mask.device
        )
        return torch.cat((text_mask, real), dim=1)

    def action_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's final states [B, n_action_tokens, dim] that predict each action token."""
        return hidden[:, self.cfg.prefix_len - 1 :]

    def action_loss_of(self, hidden: torch.Tensor, loss_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample mean cross-entropy, argmax predictions) of ``action_states`` against bin ids (-100: not counted)."""
        return self.action_loss(hidden, self.action_head.weight, loss_targets, backend=self.kernels.cross_entropy)

    def predict_actions(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """Normalised action chunk [B, horizon, action_dim] by greedy decoding: the prefix is encoded once,
        then each action token attends to the cached keys and values of everything before it."""
        hidden, cache = self.encode_prefix(images, state, text_ids, text_mask)
        last = hidden[:, -1]
        tokens = []
        for index in range(self.cfg.n_action_tokens):
            tokens.append(self.action_head(last).argmax(-1))
            if index + 1 < self.cfg.n_action_tokens:
                last = self.backbone(self.embed_actions(tokens[-1][:, None], start=index), cache=cache)[:, -1]
        bins = torch.stack(tokens, dim=1).view(-1, self.cfg.spec.action_horizon, self.cfg.spec.action_dim)
        return self.action_binner.decode(bins)
