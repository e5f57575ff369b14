"""``Policy``: a trained model as an inference object, from observations to action chunks in robot units.

    policy = Policy.from_checkpoint("runs/posttrain/checkpoints")
    actions = policy({"images": images, "state": state, "instruction": ["reach the red square"]})

Observations (a batch of B; torch tensors or numpy arrays):

- ``images``: uint8 ``[B, T, C, H, W, 3]``, the last T = ``policy.spec.n_obs_steps`` frames of each
  of the C cameras, oldest first (before an episode's first frame, repeat it);
- ``state``: float ``[B, T, state_dim]``, the robot state at the same steps, in robot units;
- ``instruction``: B strings.

Returns float32 ``[B, action_horizon, action_dim]`` actions in robot units, the first to execute
first, whatever the model's dtype (it computes in its own). No gradients; the model is in eval
mode. The normalisation statistics are buffers, so ``state_dict()`` holds everything the policy
needs to act (what an RL learner publishes to actors).
Evaluation during training, ``uma predict`` and the closed-loop evaluation all go through this object.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
from torch import nn

from uma_lightning.checkpoint.hf import materialise
from uma_lightning.checkpoint.weights import load_weights, read_checkpoint
from uma_lightning.data.spec import DataSpec
from uma_lightning.default_dtype import default_dtype
from uma_lightning.models.lora import merge_lora
from uma_lightning.models.network import grouped_settings, spec_of


class Policy(nn.Module):
    def __init__(self, model: nn.Module, spec: DataSpec, normalization: dict, options: dict[str, Any] | None = None):
        """
        Args:
            model: A network with ``predict_actions(images, state, text_ids, text_mask, **options)``
                returning normalised chunks, and a ``text_tokenizer`` (``PolicyNetwork`` in ``models/contract.py``).
            spec: Data shapes the model was built for.
            normalization: ``{"state": {...}, "action": {...}}``, each with ``offset`` and ``scale``
                (normalised = (raw - offset) / scale) and optionally ``names`` of the dimensions.
            options: Keyword arguments for ``predict_actions`` (e.g. ``steps`` of a flow-matching sampler).
        """
        super().__init__()
        self.model = model
        self.spec = spec
        self.options = dict(options or {})
        self.state_names = list(normalization["state"].get("names") or [])
        self.action_names = list(normalization["action"].get("names") or [])
        device = next(model.parameters()).device
        for key in ("state", "action"):
            for part in ("offset", "scale"):
                values = torch.as_tensor(np.asarray(normalization[key][part], dtype=np.float32), device=device)
                self.register_buffer(f"{key}_{part}", values)

    @classmethod
    def from_checkpoint(
        cls, path: str, device: str | torch.device = "cpu", use_ema: bool = True, module_class: type | None = None
    ) -> Policy:
        """Rebuild the network a stage module trained and load its weights (the EMA weights when the
        checkpoint has them and ``use_ema``), LoRA adapters folded in.

        The network is built from the checkpoint's hyperparameters by the function the checkpoint
        names (``models/network.py``), which needs neither the module class nor Lightning. A module
        class that builds its network otherwise is imported and rebuilt from the same hyperparameters
        (every constructor argument it had), as is ``module_class`` when given.
        """
        source = read_checkpoint(path, prefer_ema=use_ema)
        hparams = grouped_settings(source.hparams)
        if not hparams.get("normalization"):
            raise ValueError(
                f"{path}: no normalization statistics in the checkpoint's hyperparameters; cannot undo the normalisation"
            )
        if module_class is None and source.network_builder:
            model, options = _imported(source.network_builder, path)(hparams)
        else:
            if module_class is None:
                if not source.module_class:
                    raise ValueError(f"{path}: the checkpoint does not record its module class; pass module_class=")
                module_class = _imported(source.module_class, path)
            if not (isinstance(module_class, type) and callable(getattr(module_class, "build_model", None))):
                raise ValueError(f"{path}: module class {module_class!r} is not a uma_lightning StageModule")
            module = module_class(**{**hparams, "init_from": None})
            model, options = module.build_model(), module.inference_options()
        materialise(model, "cpu")  # a pretrained model's part is built on the meta device; the checkpoint fills it
        load_weights(model, source)
        merge_lora(model)
        policy = cls(model, spec_of(hparams), hparams["normalization"], options)
        return policy.to(device).eval()

    # ---- normalisation ------------------------------------------------------------------------

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        return (state - self.state_offset) / self.state_scale

    def denormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return actions * self.action_scale + self.action_offset

    # ---- inference ----------------------------------------------------------------------------

    def predict_normalized(
        self, images: torch.Tensor, state: torch.Tensor, instruction: list[str], **overrides
    ) -> torch.Tensor:
        """Normalised action chunks [B, horizon, action_dim] from normalised state [B, T, state_dim]."""
        text_ids, text_mask = self.model.text_tokenizer(list(instruction), device=state.device)
        return self.model.predict_actions(images, state, text_ids, text_mask, **{**self.options, **overrides})

    @torch.no_grad()
    def forward(self, obs: dict[str, Any], **overrides) -> torch.Tensor:
        """Action chunks in robot units for a batch of observations (see the module docstring).
        ``overrides`` replace inference options for this call, e.g. ``noise=`` or ``steps=`` for flow matching."""
        device = self.state_offset.device
        images = torch.as_tensor(obs["images"], device=device)
        state = torch.as_tensor(obs["state"], device=device, dtype=torch.float32)
        instruction = [obs["instruction"]] if isinstance(obs["instruction"], str) else list(obs["instruction"])
        spec = self.spec
        steps, cameras = spec.n_obs_steps, len(spec.cameras)
        expected_images = (steps, cameras, *spec.image_size, 3)
        if images.dim() != 6 or tuple(images.shape[1:]) != expected_images or images.dtype != torch.uint8:
            raise ValueError(
                f"images must be uint8 [B, {', '.join(map(str, expected_images))}], got {images.dtype} {list(images.shape)}"
            )
        if tuple(state.shape) != (images.shape[0], steps, spec.state_dim):
            raise ValueError(f"state must be [B={images.shape[0]}, {steps}, {spec.state_dim}], got {list(state.shape)}")
        if len(instruction) != images.shape[0]:
            raise ValueError(f"{len(instruction)} instructions for a batch of {images.shape[0]}")
        # A model in a half type (bf16-true training, or a policy moved to one) computes in it
        # throughout: its inputs, given noise, and what it creates itself (flow noise, time embeddings).
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        overrides = {
            k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in overrides.items()
        }
        with default_dtype(dtype):
            normalized = self.predict_normalized(
                images, self.normalize_state(state).to(dtype), instruction, **overrides
            )
        return self.denormalize_actions(normalized.float()).float()


def _imported(name: str, path: str):
    """The object named ``"package.module:name"`` or ``"package.module.Name"`` in a checkpoint."""
    module_name, _, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{path}: cannot import {name!r}, which the checkpoint names ({err})") from None
