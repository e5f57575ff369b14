"""Robot models whose backbone is a pretrained Hugging Face vision-language model (``network.pretrained``).

The model comes from a local directory, as ``save_pretrained`` writes it (or a snapshot copied there):
``config.json``, the safetensors weights, the tokenizer files and the image processor's config.
Nothing is downloaded. ``transformers`` is imported here only, when such a model is built (the ``hf``
extra); the house models never need it.

Weights convention, which loading and export rely on: the network holds the ``transformers`` model
(``*ForConditionalGeneration``, built from the directory's config) at the attribute named by
``hf_prefix`` (``"vlm"``), so its parameters are ``vlm.<the transformers model's own state_dict key>``;
the directory is ``cfg.directory``. The safetensors file names the same tensors after transformers'
checkpoint conversion (``transformers.conversion_mapping``: PaliGemma's file says
``language_model.model.*`` for ``model.language_model.*``) and without tied copies
(``_tied_weights_keys``, e.g. PaliGemma's ``lm_head.weight``).

Token layout of one sample (causal attention, as the family's language model was trained):

    [ obs step 1: camera 1 image tokens, camera 2 ... | ... | obs step T | instruction | state 1 ... state T | actions ]
    '------------------------------------------ prefix ---------------------------------------------'

Images come first and the instruction after them, as the families' own prompts place them, so the
image and instruction positions are exactly the family's own forward on the same image tokens and
text; the state tokens (a linear projection per observation step) see everything before them. The
frames' normalisation and resolution are the image processor's, applied inside the model on uint8
frames (resized to the vision tower's ``image_size`` when they differ). The instruction is encoded by
the model's own fast tokenizer, padded or cut to ``max_text_len`` tokens.

- ``VLMTokenModel`` (pretraining, mid-training): discretised action tokens after the prefix, each
  predicted from the hidden state before it, as ``RobotTransformer``;
- ``VLMFlowModel`` (post-training): pi0's action expert (``models/flow.py``), a transformer of its own
  width with one layer per language-model layer, attending to that layer's keys and values of the prefix.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig
from uma_lightning.models.flow import ActionExpert, ActionExpertConfig
from uma_lightning.models.robot import LinearCrossEntropy, embed_action_tokens
from uma_lightning.models.tokenizers import ActionBinner
from uma_lightning.models.transformer import KVCache, LayerKV, TransformerConfig
from uma_lightning.models.units import outermost_of_classes


@dataclass(frozen=True)
class Family:
    """What differs between the supported families: whether the image tokens come straight from the
    vision tower and its connector (Idefics3, whose ``get_image_features`` first drops all-zero
    "padding" images: a shape known only from the values, so a host sync every step and no FLOP count
    on fake tensors, for images that are all real here) or from ``get_image_features`` (PaliGemma), and
    how many tokens the connector leaves of the patches (Idefics3's pixel shuffle merges
    ``scale_factor``² of them)."""

    tower_then_connector: bool
    merges_patches: bool

    def tokens_per_image(self, config) -> int:
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches // config.scale_factor**2 if self.merges_patches else patches


#: The families a backbone can be built from, by ``model_type`` in config.json.
FAMILIES = {
    "idefics3": Family(tower_then_connector=True, merges_patches=True),
    "paligemma": Family(tower_then_connector=False, merges_patches=False),
}

#: The parts of a language-model layer its keys and values depend on (Llama and Gemma names).
KEY_VALUE_PARTS = ("input_layernorm", "self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")


def read_config(directory: str | Path) -> dict:
    """The model's ``config.json``; one clear error when the directory is not a model's."""
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise ValueError(f"network.pretrained {directory}: no config.json there (a directory save_pretrained wrote)")
    config = json.loads(path.read_text())
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"network.pretrained {directory}: model_type {family!r} is not a supported vision-language family "
            f"({', '.join(FAMILIES)})"
        )
    return config


@dataclass(frozen=True)
class VLMModelConfig:
    """What a VLM-backed robot model is built from.

    ``directory``: the Hugging Face model directory; ``max_text_len``: instruction tokens;
    ``freeze_vision``: the vision tower and its connector keep their loaded weights.
    """

    directory: str
    spec: DataSpec
    max_text_len: int = 32
    n_action_bins: int = 256
    freeze_vision: bool = False


def import_transformers():
    """The ``transformers`` module. In a source checkout, the repository's ``kernels/`` folder (the
    source of ``uma_lightning.kernels``) would shadow the ``kernels`` distribution that transformers
    imports (lazily, when a model class is first used) wherever Python runs from the repository's root
    (``python -m ...``): that distribution is imported first, with the root off ``sys.path``."""
    ours = Path(__file__).resolve().parents[2] / "kernels"
    loaded = sys.modules.get("kernels")
    if loaded is None or Path(getattr(loaded, "__file__", None) or ".").resolve().parent == ours:
        sys.modules.pop("kernels", None)
        shadowing = [entry for entry in sys.path if Path(entry or ".").resolve() / "kernels" == ours]
        sys.path[:] = [entry for entry in sys.path if entry not in shadowing]
        try:
            importlib.import_module("kernels")
        except ImportError:  # transformers runs without it
            pass
        finally:
            sys.path[:0] = shadowing
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ValueError("network.pretrained needs transformers: pip install 'uma-lightning[hf]'") from err


class VLMBase(nn.Module):
    """The pretrained VLM at ``vlm``, its tokenizer and image normalisation, and the state projection.

    Parameter names are the same in every subclass, so post-training starts from a pretraining
    checkpoint by name."""

    hf_prefix = "vlm"

    def __init__(self, cfg: VLMModelConfig):
        super().__init__()
        transformers = import_transformers()
        self.cfg = cfg
        directory = Path(cfg.directory).expanduser()
        config = transformers.AutoConfig.from_pretrained(directory)
        family = FAMILIES[config.model_type]
        self.tower_then_connector = family.tower_then_connector
        self.tokens_per_image = family.tokens_per_image(config)
        # From the config only, on the meta device: the weights come after the strategy has laid the
        # model out (``pretrained_weights``), so no process holds more of them than its own part.
        with torch.device("meta"):
            self.vlm = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.get_default_dtype())
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        self.image_size = config.vision_config.image_size
        offset, scale = _pixel_normalisation(transformers, directory)
        self.register_buffer("pixel_offset", offset, persistent=False)
        self.register_buffer("pixel_scale", scale, persistent=False)
        text = config.get_text_config()
        self.dim = text.hidden_size
        self.state_proj = nn.Linear(cfg.spec.state_dim, self.dim)
        self.kernels = KernelConfig()
        keep_float64_norms(self.vlm)
        if cfg.freeze_vision:
            self.freeze_vision()
        self._freeze_unused_head()

    def set_kernels(self, kernels: KernelConfig) -> None:
        """The op implementations of the parts of ours (the loss); the VLM runs transformers' own."""
        self.kernels = kernels

    def pretrained_weights(self) -> str:
        """The Hugging Face directory whose weights the ``transformers`` model at ``hf_prefix`` starts
        from: it is built on the meta device, and the stage loads them once the model is laid out."""
        return str(Path(self.cfg.directory).expanduser())

    # ---- parallel layouts, as data (read by the generic plan, ``parallel/plans/generic.py``) -------

    def fsdp_units(self) -> list[nn.Module]:
        """What data parallelism wraps one by one: the outermost modules of the classes the family's
        ``_no_split_modules`` names (its decoder layers, its vision tower's layers)."""
        return outermost_of_classes(self.vlm, self.vlm._no_split_modules or ())

    @property
    def tp_plan(self) -> dict[str, str]:
        """The language model's tensor-parallel layout, from its config's ``base_model_tp_plan``; the
        vision tower is computed whole on every tp rank (replicated)."""
        text = self.vlm.config.get_text_config()
        layout = getattr(text, "base_model_tp_plan", None)
        family = self.vlm.config.model_type
        if not layout:
            raise ValueError(f"tp: {family}'s text config has no base_model_tp_plan; train it with ddp or fsdp")
        unsupported = {key: style for key, style in layout.items() if style not in ("colwise", "rowwise")}
        if unsupported:
            key, style = next(iter(unsupported.items()))
            raise ValueError(
                f"tp: {family}'s base_model_tp_plan lays out {key} as {style}; only colwise and rowwise are supported"
            )
        decoder = next(name for name, module in self.named_modules() if module is self.language_model)
        return {f"{decoder}.{key}": style for key, style in layout.items()}

    def check_tensor_parallel(self, tp: int) -> None:
        """tp must divide the language model's attention and key/value heads: each rank computes whole heads."""
        text = self.vlm.config.get_text_config()
        for what in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(text, what)
            if heads % tp:
                raise ValueError(
                    f"tp {tp} does not divide the {heads} {what.removeprefix('num_').replace('_', ' ')} of "
                    f"{self.vlm.config.model_type}'s language model ({self.cfg.directory})"
                )

    # ---- the pieces of the model contract -------------------------------------------------------

    def text_tokenizer(self, instructions: list[str], device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask [B, max_text_len] from the model's own tokenizer (cut or padded)."""
        encoded = self.tokenizer(
            list(instructions),
            padding="max_length",
            truncation=True,
            max_length=self.cfg.max_text_len,
            return_tensors="pt",
        )
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device=device, dtype=torch.bool)

    @property
    def prefix_len(self) -> int:
        spec = self.cfg.spec
        return spec.n_obs_steps * len(spec.cameras) * self.tokens_per_image + self.cfg.max_text_len + spec.n_obs_steps

    # ---- the prefix -----------------------------------------------------------------------------

    def pixel_values(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> [N, 3, S, S] as the image processor makes them (S: the tower's image size)."""
        if frames.dtype != torch.uint8:
            raise TypeError(f"camera frames must be uint8 [N, H, W, 3], got {frames.dtype}")
        dtype = self.state_proj.weight.dtype
        pixels = frames.permute(0, 3, 1, 2).to(dtype)
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            pixels = F.interpolate(pixels, size=(self.image_size,) * 2, mode="bilinear", antialias=True)
        return (pixels - self.pixel_offset.to(dtype)) * self.pixel_scale.to(dtype)

    def image_features(self, frames: torch.Tensor) -> torch.Tensor:
        """[N, tokens_per_image, dim]: the family's image tokens of uint8 frames [N, H, W, 3]."""
        pixels = self.pixel_values(frames)
        if self.tower_then_connector:
            hidden = self.vlm.model.vision_model(pixel_values=pixels.to(self.vlm.model.dtype)).last_hidden_state
            return self.vlm.model.connector(hidden)
        features = self.vlm.model.get_image_features(pixels).pooler_output
        return torch.stack(features) if isinstance(features, (list, tuple)) else features

    def embed_prefix(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's input embeddings [B, prefix_len, dim] and mask [B, prefix_len] (True on real
        tokens), from images [B, T, C, H, W, 3] uint8, state [B, T, state_dim], text ids and mask [B, L]."""
        batch = images.shape[0]
        text = self.vlm.get_input_embeddings()(text_ids)
        camera = self.image_features(images.flatten(0, 2)).to(text.dtype).reshape(batch, -1, text.shape[-1])
        states = self.state_proj(state.to(text.dtype))
        real = torch.ones(batch, camera.shape[1], dtype=torch.bool, device=text_mask.device)
        steps = torch.ones(batch, states.shape[1], dtype=torch.bool, device=text_mask.device)
        return torch.cat((camera, text, states), dim=1), torch.cat((real, text_mask, steps), dim=1)

    def run_language_model(
        self, embeds: torch.Tensor, mask: torch.Tensor, cache: Any = None, use_cache: bool = False
    ) -> Any:
        """The family's own forward of its language model on input embeddings (its positions, its
        masking), with the padding mask [B, cached + new] of every token."""
        return self.vlm.model(inputs_embeds=embeds, attention_mask=mask.long(), cache=cache, use_cache=use_cache)

    # ---- set-up ---------------------------------------------------------------------------------

    def _freeze_unused_head(self) -> None:
        """The language-model head predicts words, which no stage trains: its weights (unless tied to the
        input embeddings) get no gradient, and data-parallel wrappers would wait for it."""
        head = self.vlm.get_output_embeddings()
        embeddings = self.vlm.get_input_embeddings().weight
        if head is not None and head.weight is not embeddings:
            head.requires_grad_(False)

    @property
    def language_model(self) -> nn.Module:
        """The VLM's decoder (Idefics3's ``model.text_model``, PaliGemma's ``model.language_model``)."""
        return self.vlm.get_decoder()

    def freeze_vision(self) -> None:
        """Keep the vision tower and its connector (every part of the VLM but its language model) as loaded."""
        for module in self.vlm.model.children():
            if module is not self.language_model:
                module.requires_grad_(False)


def _pixel_normalisation(transformers, directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The offset and scale [1, 3, 1, 1] of the image processor's rescaling then normalisation:
    (x * rescale - mean) / std = (x - mean / rescale) * rescale / std. On the meta device (a plan or a
    check: the shapes only), without the processor, so that config.json and the tokenizer are enough."""
    if torch.empty(0).is_meta:
        return torch.empty(1, 3, 1, 1, dtype=torch.float64), torch.empty(1, 3, 1, 1, dtype=torch.float64)
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(directory)
    except OSError:
        raise ValueError(
            f"network.pretrained {directory}: no image processor config there (preprocessor_config.json "
            "or processor_config.json, which the processor's save_pretrained writes)"
        ) from None
    rescale = processor.rescale_factor if processor.do_rescale else 1.0
    mean = torch.tensor(processor.image_mean if processor.do_normalize else [0.0] * 3, dtype=torch.float64)
    std = torch.tensor(processor.image_std if processor.do_normalize else [1.0] * 3, dtype=torch.float64)
    return (mean / rescale).view(1, 3, 1, 1), (rescale / std).view(1, 3, 1, 1)


class VLMTokenModel(VLMBase):
    """Discretised action tokens after the prefix, predicted by the language model (pretraining, mid-training)."""

    def __init__(self, cfg: VLMModelConfig):
        super().__init__(cfg)
        self.action_binner = ActionBinner(cfg.n_action_bins)
        self.action_embed = nn.Embedding(cfg.n_action_bins, self.dim)
        self.action_dim_embed = nn.Embedding(cfg.spec.action_dim, self.dim)
        self.action_head = nn.Linear(self.dim, cfg.n_action_bins, bias=False)
        self.action_loss = LinearCrossEntropy()
        for weight in (self.action_embed.weight, self.action_dim_embed.weight, self.action_head.weight):
            nn.init.normal_(weight, std=0.02)

    @property
    def n_action_tokens(self) -> int:
        return self.cfg.spec.action_horizon * self.cfg.spec.action_dim

    @property
    def tokens_per_sample(self) -> int:
        return self.prefix_len + self.n_action_tokens - 1

    def embed_actions(self, action_tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
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
    ) -> Any:
        """Logits [B, n_action_tokens, n_bins]; with ``loss_targets``, (per-sample mean cross-entropy,
        argmax predictions), as ``RobotTransformer.forward``."""
        prefix, mask = self.embed_prefix(images, state, text_ids, text_mask)
        actions = self.embed_actions(action_tokens[:, :-1]).to(prefix.dtype)
        real = torch.ones(actions.shape[:2], dtype=torch.bool, device=mask.device)
        hidden = self.run_language_model(torch.cat((prefix, actions), 1), torch.cat((mask, real), 1)).last_hidden_state
        hidden = hidden[:, prefix.shape[1] - 1 :]
        if loss_targets is None:
            return self.action_head(hidden)
        return self.action_loss(hidden, self.action_head.weight, loss_targets, backend=self.kernels.cross_entropy)

    def predict_actions(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """Greedy decoding of the action tokens, the prefix encoded once into the family's cache."""
        prefix, mask = self.embed_prefix(images, state, text_ids, text_mask)
        out = self.run_language_model(prefix, mask, use_cache=True)
        tokens = []
        for index in range(self.n_action_tokens):
            tokens.append(self.action_head(out.last_hidden_state[:, -1]).argmax(-1))
            if index + 1 < self.n_action_tokens:
                mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
                embed = self.embed_actions(tokens[-1][:, None], start=index).to(prefix.dtype)
                out = self.run_language_model(embed, mask, cache=out.cache, use_cache=True)
        bins = torch.stack(tokens, dim=1).view(-1, self.cfg.spec.action_horizon, self.cfg.spec.action_dim)
        return self.action_binner.decode(bins)


class VLMFlowModel(ActionExpert, VLMBase):
    """pi0: the VLM encodes the prefix once; a flow-matching action expert of its own width attends to
    each language-model layer's keys and values of it (post-training)."""

    def __init__(self, cfg: VLMModelConfig, expert: ActionExpertConfig | None = None):
        super().__init__(cfg)
        text = self.vlm.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if text.hidden_size != head_dim * text.num_attention_heads:
            raise ValueError(
                f"network.pretrained {cfg.directory}: the action expert needs hidden_size = heads x head_dim "
                f"({text.hidden_size} != {text.num_attention_heads} x {head_dim})"
            )
        language_model = TransformerConfig(
            dim=text.hidden_size,
            n_layers=text.num_hidden_layers,
            n_heads=text.num_attention_heads,
            n_kv_heads=text.num_key_value_heads,
            ffn_dim=text.intermediate_size,
            norm_eps=text.rms_norm_eps,
            rope_theta=_rope_theta(text),
        )
        self.build_action_expert(
            (expert or ActionExpertConfig()).transformer_config(language_model),
            cfg.spec.action_dim,
            max_seq_len=self.prefix_len + cfg.spec.action_horizon,
        )
        self.init_action_expert()
        self.freeze_what_gets_no_gradient()

    @property
    def tokens_per_sample(self) -> int:
        return self.prefix_len + self.cfg.spec.action_horizon

    def fsdp_units(self) -> list[nn.Module]:
        """The VLM's units but its last decoder layer, then the expert's blocks. Only that layer's keys and
        values reach the loss, through the family's cache rather than the layer's outputs, where data
        parallel wrappers hook the gathering of a unit's weights for backward: its weights stay with
        the root's."""
        last = self.language_model.layers[-1]
        return [unit for unit in super().fsdp_units() if unit is not last] + list(self.expert.layers)

    @property
    def tp_plan(self) -> dict[str, str]:
        """The language model's layout, and Megatron's split of the expert's attention and feed-forwards
        (its heads follow the language model's key/value heads, which its queries attend to)."""
        expert = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
                  "ffn.w1": "colwise", "ffn.w3": "colwise", "ffn.w2": "rowwise"}  # fmt: skip
        return {**super().tp_plan, **{f"expert.layers.*.{key}": style for key, style in expert.items()}}

    def set_kernels(self, kernels: KernelConfig) -> None:
        super().set_kernels(kernels)
        self.expert.set_kernels(kernels)

    def freeze_what_gets_no_gradient(self) -> None:
        """The expert reads the prefix's keys and values only: the final norm and, in the last layer,
        what its keys and values do not depend on get no gradient (``RobotFlowTransformer``'s reason)."""
        language_model = self.language_model
        language_model.norm.requires_grad_(False)
        last = language_model.layers[-1]
        for name, parameter in last.named_parameters():
            if not name.startswith(KEY_VALUE_PARTS):
                parameter.requires_grad_(False)

    def encode_prefix(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> KVCache:
        """The keys and values of the prefix, per language-model layer, with its padding mask."""
        prefix, mask = self.embed_prefix(images, state, text_ids, text_mask)
        cache = import_transformers().Cache(layer_class_to_replicate=_prefix_layer_class())
        self.run_language_model(prefix, mask, cache=cache, use_cache=True)
        return KVCache([LayerKV(layer.keys, layer.values) for layer in cache.layers], mask)

    def forward(
        self,
        images: torch.Tensor,
        state: torch.Tensor,
        text_ids: torch.Tensor,
        text_mask: torch.Tensor,
        noisy_actions: torch.Tensor,
        t: torch.Tensor,
    ) -> torch.Tensor:
        """Predicted velocity [B, horizon, action_dim] of noisy chunks at times t [B]."""
        return self.velocity(self.encode_prefix(images, state, text_ids, text_mask), noisy_actions, t)

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
        """Normalised action chunk [B, horizon, action_dim]: Euler steps from noise, one prefix cache."""
        return self.sample_actions(
            self.encode_prefix(images, state, text_ids, text_mask), state, steps, noise, noise_scale
        )


@functools.cache
def _prefix_layer_class() -> type:
    """A layer of transformers' cache that keeps the keys and values of the one pass over the prefix,
    replaced (not extended) when the layer runs again: activation checkpointing recomputes it in backward."""
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    return PrefixLayer


class _Float64GemmaNorm:
    """Gemma's RMS norm, computed in float64 when its input is (``uma parity``): transformers'
    computes it in float32 whatever the model's dtype, weight gradient included, whose sum over the
    batch then depends on how the batch is split. Other dtypes take transformers' own path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            return super().forward(x)
        return self._norm(x) * (1.0 + self.weight)


#: Norm classes of the families that compute in float32 whatever the model's dtype, and their float64 forms.
_FLOAT64_FORMS = {"GemmaRMSNorm": _Float64GemmaNorm}


def keep_float64_norms(model: nn.Module) -> None:
    """Give ``model``'s norms that compute in float32 a forward that keeps float64 inputs in float64."""
    forms: dict[type, type] = {}
    for module in model.modules():
        form = _FLOAT64_FORMS.get(type(module).__name__)
        if form is not None:
            kind = type(module)
            forms.setdefault(kind, type(kind.__name__, (form, kind), {"__module__": kind.__module__}))
            module.__class__ = forms[kind]


def _rope_theta(text_config) -> float:
    parameters = getattr(text_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))
