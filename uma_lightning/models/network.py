"""The network a training stage trains, built from plain settings: no LightningModule, no Lightning.

``NetworkConfig`` holds what every stage's network shares; it is the ``network`` section of a stage
module's arguments. A stage module builds its network with one of the builders below, from its own
saved hyperparameters, and names that builder in its checkpoints, so ``Policy.from_checkpoint``
rebuilds exactly the trained network from the checkpoint alone:

- ``token_network``: pretraining and mid-training (discrete action tokens; ``n_action_bins``);
- ``flow_network``: post-training (a flow-matching action expert; ``expert``, ``flow``, ``lora``).

With ``network.pretrained``, both build their model around a Hugging Face vision-language model
(``models/vlm.py``) instead of the house backbone.

Each takes a module's hyperparameters (``spec``, ``network`` and the stage's own keys) and returns the
network and the keyword arguments of its ``predict_actions`` at inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig, convert_to_float8
from uma_lightning.models.flow import ActionExpertConfig, RobotFlowTransformer
from uma_lightning.models.flow_matching import FlowMatchingConfig
from uma_lightning.models.lora import LoraConfig, add_lora
from uma_lightning.models.robot import RobotModelConfig, RobotTransformer
from uma_lightning.models.sizes import ModelSize, load_size
from uma_lightning.models.tokenizers import VisionConfig
from uma_lightning.models.vlm import VLMFlowModel, VLMModelConfig, VLMTokenModel, read_config


@dataclass
class NetworkConfig:
    """What the network is, in every stage (a later stage starts from an earlier one's weights, so keep it the same).

    Args:
        size: Backbone size: a preset name (tiny, small, 1b, 7b), a YAML file, or a dict of dimensions
            (``{"name": "small", "n_layers": 6}`` starts from a preset).
        vision: How camera frames become tokens: ``tokenizer`` patches (``patch_size``) or keypoints
            (``n_keypoints``, ``channels``, ``film``); see ``VisionConfig``.
        max_text_len: Instructions are cut or padded to this many UTF-8 bytes.
        kernels: Implementation of each op; see ``KernelConfig``.
        environment_state_weight: Weight of an auxiliary loss, the mean squared error of a linear head on
            the last observation token predicting the data's (normalised) environment state, e.g. where the
            named target is. 0 builds no head. Needs data that records one.
        pretrained: A local directory holding a Hugging Face vision-language model (``config.json``,
            safetensors weights, tokenizer files, image processor config: what ``save_pretrained`` writes)
            whose vision tower and language model are the backbone, and whose tokenizer encodes the
            instruction (``max_text_len`` tokens); ``size`` and ``vision`` are then unused. Families:
            idefics3 and smolvlm (SmolVLM), paligemma. None: the house backbone. Needs the ``hf`` extra.
        freeze_vision: With ``pretrained``: the vision tower and its connector keep their loaded weights,
            the language model trains.
    """

    size: ModelSize = "tiny"
    vision: VisionConfig = field(default_factory=VisionConfig)
    max_text_len: int = 32
    kernels: KernelConfig = field(default_factory=KernelConfig)
    environment_state_weight: float = 0.0
    pretrained: Optional[str] = None
    freeze_vision: bool = False

    def __post_init__(self) -> None:
        # Saved hyperparameters and Python callers give the sub-sections as dicts.
        if isinstance(self.vision, Mapping):
            self.vision = VisionConfig(**self.vision)
        if isinstance(self.kernels, Mapping):
            self.kernels = KernelConfig(**self.kernels)
        if self.environment_state_weight < 0:
            raise ValueError(f"network.environment_state_weight must be >= 0, got {self.environment_state_weight}")
        self.environment_state_weight = float(self.environment_state_weight)
        if self.pretrained is not None:
            self.pretrained = str(self.pretrained)
            read_config(self.pretrained)  # one clear line when it is not a model directory of a known family
            if self.environment_state_weight:
                raise ValueError("network.environment_state_weight: not available with network.pretrained")
        elif self.freeze_vision:
            raise ValueError("network.freeze_vision freezes a pretrained vision tower: set network.pretrained")

    def vlm_config(self, spec: DataSpec, **stage_fields: Any) -> VLMModelConfig:
        return VLMModelConfig(
            self.pretrained, spec, self.max_text_len, freeze_vision=self.freeze_vision, **stage_fields
        )

    def robot_config(self, spec: DataSpec, **stage_fields: Any) -> RobotModelConfig:
        if self.environment_state_weight and not spec.environment_state_dim:
            raise ValueError(
                f"network.environment_state_weight {self.environment_state_weight} needs data that records "
                "observation.environment_state; this data has none (or not every dataset of the mixture has it)"
            )
        return RobotModelConfig(
            backbone=load_size(self.size),
            spec=spec,
            vision=self.vision,
            max_text_len=self.max_text_len,
            environment_state_head=self.environment_state_weight > 0,
            **stage_fields,
        )


#: The network settings of checkpoints and recipes written before they were grouped into ``network``.
FLAT_NETWORK_KEYS = tuple(f.name for f in dataclasses.fields(NetworkConfig))


def grouped_settings(hparams: Mapping) -> dict:
    """A stage module's hyperparameters with the network settings of an older checkpoint (saved flat,
    as ``size``, ``vision``, ...) moved into the ``network`` section."""
    flat = {key: hparams[key] for key in FLAT_NETWORK_KEYS if key in hparams}
    if not flat:
        return dict(hparams)
    return {
        **{k: v for k, v in hparams.items() if k not in flat},
        "network": {**flat, **(hparams.get("network") or {})},
    }


def use_kernels(model: nn.Module, kernels: KernelConfig, transformers: list[nn.Module]) -> None:
    """Give a freshly built model its op implementations; with float8 linears, convert the
    ``transformers`` (the heads stay in higher precision)."""
    model.set_kernels(kernels)
    if kernels.linear == "float8":
        for transformer in transformers:
            convert_to_float8(transformer)


def spec_of(hparams: Mapping) -> DataSpec:
    spec = hparams["spec"]
    return DataSpec(**spec) if isinstance(spec, Mapping) else spec


def network_of(hparams: Mapping) -> NetworkConfig:
    network = hparams.get("network") or {}
    return NetworkConfig(**network) if isinstance(network, Mapping) else network


def token_network(hparams: Mapping) -> tuple[nn.Module, dict[str, Any]]:
    """Pretraining's and mid-training's network: next-token prediction of discretised actions."""
    network = network_of(hparams)
    bins = hparams.get("n_action_bins", 256)
    if network.pretrained:
        model = VLMTokenModel(network.vlm_config(spec_of(hparams), n_action_bins=bins))
        use_kernels(model, network.kernels, [])
        return model, {}
    model = RobotTransformer(network.robot_config(spec_of(hparams), n_action_bins=bins))
    use_kernels(model, network.kernels, [model.backbone])
    return model, {}


def flow_network(hparams: Mapping) -> tuple[nn.Module, dict[str, Any]]:
    """Post-training's network: the backbone with a flow-matching action expert, LoRA adapters where asked."""
    network = network_of(hparams)
    expert = _section(hparams.get("expert"), ActionExpertConfig)
    if network.pretrained:
        model = VLMFlowModel(network.vlm_config(spec_of(hparams)), expert)
        use_kernels(model, network.kernels, [model.expert])
    else:
        model = RobotFlowTransformer(network.robot_config(spec_of(hparams)), expert)
        use_kernels(model, network.kernels, [model.backbone, model.expert])
    lora = _section(hparams.get("lora"), LoraConfig) if hparams.get("lora") is not None else None
    if lora and lora.targets:
        add_lora(model, lora.targets, lora.rank, lora.alpha)
        model.freeze_what_gets_no_gradient()  # the adapters just added too
    return model, flow_inference_options(_section(hparams.get("flow"), FlowMatchingConfig))


def flow_inference_options(flow: FlowMatchingConfig) -> dict[str, Any]:
    return {"steps": flow.sample_steps, "noise_scale": flow.noise_scale}


def _section(value, kind: type):
    return kind(**value) if isinstance(value, Mapping) else (value or kind())
