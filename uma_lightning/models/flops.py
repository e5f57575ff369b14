"""Parameter count and training FLOPs of the robot transformer, computed from its config.

FLOPs count matrix multiplies only (2 per multiply-add), as ``torch.utils.flop_counter`` does, and
attention as the dense S x S product that SDPA computes. Training is forward + backward, where a
backward costs twice its forward, except for products with one operand that needs no gradient
(layers fed directly by data: the patch projection, the keypoint net's first convolution, the state
projection; and the keypoints' product with their fixed coordinate grid), whose backward costs once
their forward.

Mixture-of-experts layers (``moe.py``) count two ways: ``count_parameters`` holds every expert,
``count_active_parameters`` and every FLOP count only what one token uses (the router, its top_k
experts and the shared ones), so MFU is measured on the work actually done.
"""

from __future__ import annotations

from uma_lightning.models.robot import RobotModelConfig
from uma_lightning.models.tokenizers import ByteTokenizer
from uma_lightning.models.transformer import TransformerConfig


def count_parameters(cfg: RobotModelConfig, active: bool = False) -> int:
    """Every parameter of the model; with ``active``, those one token uses (experts it is not routed to left out)."""
    b, spec = cfg.backbone, cfg.spec
    layers = sum(_layer_parameters(b, index, active) for index in range(b.n_layers))
    patch = _image_tokenizer_parameters(cfg)
    embeddings = (ByteTokenizer.vocab_size + len(spec.cameras) + cfg.n_action_bins + spec.action_dim) * b.dim
    state = spec.state_dim * b.dim + b.dim
    head = b.dim * cfg.n_action_bins
    return layers + b.dim + patch + embeddings + state + head + _environment_state_head_parameters(cfg)


def count_active_parameters(cfg: RobotModelConfig) -> int:
    return count_parameters(cfg, active=True)


def _attention_parameters(b: TransformerConfig) -> int:
    return b.dim * (b.n_heads + 2 * b.n_kv_heads) * b.head_dim + b.n_heads * b.head_dim * b.dim


def _feed_forward_parameters(b: TransformerConfig, index: int, active: bool) -> int:
    """Weights of layer ``index``'s feed-forward (all experts, or with ``active`` the ones a token runs through)."""
    if not b.is_moe_layer(index):
        return 3 * b.dim * b.ffn_dim
    moe = b.moe
    experts = moe.top_k if active else moe.n_experts
    return b.dim * moe.n_experts + 3 * b.dim * moe.hidden(b.ffn_dim) * (experts + moe.n_shared)


def _layer_parameters(b: TransformerConfig, index: int, active: bool) -> int:
    return _attention_parameters(b) + _feed_forward_parameters(b, index, active) + 2 * b.dim


def _environment_state_head_parameters(cfg: RobotModelConfig) -> int:
    return (cfg.backbone.dim + 1) * cfg.spec.environment_state_dim if cfg.environment_state_head else 0


def _environment_state_head_flops(cfg: RobotModelConfig) -> int:
    return 2 * cfg.backbone.dim * cfg.spec.environment_state_dim if cfg.environment_state_head else 0


def _image_tokenizer_parameters(cfg: RobotModelConfig) -> int:
    v, dim = cfg.vision, cfg.backbone.dim
    if v.tokenizer == "patches":
        return 3 * v.patch_size**2 * dim + dim + cfg.tokens_per_image * dim
    c, k = v.channels, v.n_keypoints
    convolutions = (3 * 25 * c + c) + (c * 9 * c + c) + (c * 9 * 2 * c + 2 * c) + 2 * c * k
    film = dim * 4 * c + 4 * c if v.film else 0
    return convolutions + film + 1 + 2 * dim + dim + k * dim  # + the sharpness


def _image_tokenizer_flops(cfg: RobotModelConfig) -> tuple[int, int]:
    """Forward FLOPs of the image tokenizer over one sample's frames: (once-backward part, twice-backward part)."""
    v, dim, spec = cfg.vision, cfg.backbone.dim, cfg.spec
    n_images = spec.n_obs_steps * len(spec.cameras)
    if v.tokenizer == "patches":
        return 2 * n_images * cfg.tokens_per_image * 3 * v.patch_size**2 * dim, 0
    height, width = spec.image_size
    cells, c, k = (height // 2) * (width // 2), v.channels, v.n_keypoints
    first_convolution = height * width * c * 3 * 25
    expected_position = k * cells * 2
    later_convolutions = cells * (c * 9 * c + 2 * c * 9 * c + k * 2 * c)
    coordinates = k * 2 * dim
    film = dim * 4 * c if v.film else 0
    return 2 * n_images * (first_convolution + expected_position), 2 * n_images * (
        later_convolutions + coordinates + film
    )


def _linear_per_token(b: TransformerConfig, index: int) -> int:
    """Multiply-adds of one token through layer ``index``'s projections and feed-forward (its experts only)."""
    return _attention_parameters(b) + _feed_forward_parameters(b, index, active=True)


def _backbone_linear_per_token(b: TransformerConfig) -> int:
    return sum(_linear_per_token(b, index) for index in range(b.n_layers))


def _data_fed_flops(cfg: RobotModelConfig) -> int:
    spec = cfg.spec
    return _image_tokenizer_flops(cfg)[0] + 2 * spec.n_obs_steps * spec.state_dim * cfg.backbone.dim


def forward_flops_per_sample(cfg: RobotModelConfig) -> dict[str, int]:
    """Forward FLOPs of one sample, split into the parts whose backward costs differ."""
    b, seq = cfg.backbone, cfg.seq_len
    return {
        "data_fed": _data_fed_flops(cfg),
        "image_features": _image_tokenizer_flops(cfg)[1],
        "backbone_linear": 2 * seq * _backbone_linear_per_token(b),
        "attention": 4 * b.n_layers * b.n_heads * seq * seq * b.head_dim,
        "head": 2 * cfg.n_action_tokens * b.dim * cfg.n_action_bins + _environment_state_head_flops(cfg),
    }


def training_flops_per_sample(cfg: RobotModelConfig) -> int:
    parts = forward_flops_per_sample(cfg)
    return 2 * parts["data_fed"] + 3 * (
        parts["image_features"] + parts["backbone_linear"] + parts["attention"] + parts["head"]
    )


def training_flops_per_unit(cfg: RobotModelConfig) -> tuple[int, list[int], int]:
    """Training FLOPs of one sample in (the tokenizers, each backbone layer, the head); they add up
    to ``training_flops_per_sample``. What a pipeline split balances."""
    parts, b, seq = forward_flops_per_sample(cfg), cfg.backbone, cfg.seq_len
    attention = 4 * b.n_heads * seq * seq * b.head_dim
    layers = [3 * (2 * seq * _linear_per_token(b, index) + attention) for index in range(b.n_layers)]
    return 2 * parts["data_fed"] + 3 * parts["image_features"], layers, 3 * parts["head"]


def flow_training_flops_per_sample(cfg: RobotModelConfig, expert: TransformerConfig) -> int:
    """Training FLOPs of one sample of the flow-matching model (``flow.py``), every parameter trainable:
    the backbone over the prefix, the action expert over the chunk attending to prefix and chunk.

    The expert reads only the keys and values of the backbone's last layer, so without an
    environment-state head (which reads the last layer's output) that layer's query, attention,
    output projection and feed-forward run forward but get no backward.
    """
    b, prefix, horizon, action_dim = cfg.backbone, cfg.prefix_len, cfg.spec.action_horizon, cfg.spec.action_dim
    w = expert.dim
    data_fed = _data_fed_flops(cfg) + 2 * horizon * action_dim * w  # + the noisy actions' input projection
    backbone_attention = 4 * b.n_heads * prefix * prefix * b.head_dim  # per layer
    trained = (
        _image_tokenizer_flops(cfg)[1]
        + 2 * prefix * _backbone_linear_per_token(b)
        + b.n_layers * backbone_attention
        + 2 * horizon * _backbone_linear_per_token(expert)
        + 4 * expert.n_layers * expert.n_heads * horizon * (prefix + horizon) * expert.head_dim
        + 2 * horizon * (2 * w * w + w * w + w * action_dim)  # action-time MLP and output projection
        + _environment_state_head_flops(cfg)
    )
    key_value_projection = 2 * b.dim * b.n_kv_heads * b.head_dim
    forward_only = (
        0
        if cfg.environment_state_head
        else 2 * prefix * (_linear_per_token(b, b.n_layers - 1) - key_value_projection) + backbone_attention
    )
    return 2 * data_fed + 3 * trained - 2 * forward_only


def training_flops_per_token(cfg: RobotModelConfig) -> float:
    return training_flops_per_sample(cfg) / cfg.seq_len
