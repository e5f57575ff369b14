"""Pretraining: next-token prediction of discretised action chunks, conditioned on images, state and language.

Research code subclasses ``PretrainModule`` and overrides one extension point (see ``base.py``):
``build_model()``, ``compute_loss(batch)``, ``build_optimizer(params)`` or ``build_scheduler(optimizer)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig
from uma_lightning.models import RobotTransformer, training_flops_per_sample
from uma_lightning.models.sizes import ModelSize
from uma_lightning.models.tokenizers import VisionConfig
from uma_lightning.modules.base import OptimizerConfig, StageModule


class PretrainModule(StageModule):
    key_metric = "val/token_accuracy"

    def __init__(
        self,
        spec: Optional[DataSpec] = None,
        size: ModelSize = "tiny",
        vision: Optional[VisionConfig] = None,
        max_text_len: int = 32,
        n_action_bins: int = 256,
        kernels: Optional[KernelConfig] = None,
        optimizer: Optional[OptimizerConfig] = None,
        init_from: Optional[str] = None,
        normalization: Optional[dict] = None,
        environment_state_weight: float = 0.0,
    ):
        """
        Args:
            spec: Data shapes the model is built for; ``uma fit`` links it from the data module.
            size: Backbone size: a preset name (tiny, small, 1b, 7b), a YAML file, or a dict of dimensions.
            vision: How camera frames become tokens: ``tokenizer`` patches (``patch_size``) or
                keypoints (``n_keypoints``, ``channels``); see ``VisionConfig``.
            max_text_len: Instructions are cut or padded to this many UTF-8 bytes.
            n_action_bins: Each normalised action dimension is discretised into this many uniform bins.
            kernels: Implementation of each op. attention: auto, flash_attn, flash_attn_4, sdpa,
                sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math or reference; rms_norm, swiglu,
                rotary, cross_entropy: auto, triton or torch; linear: torch or float8 (torchao).
            optimizer: AdamW and learning-rate schedule settings.
            init_from: Checkpoint of an earlier run to start from (weights only). None: random weights.
            normalization: State and action normalisation of the data; ``uma`` links it from the data module.
            environment_state_weight: Weight of the auxiliary environment-state loss (see ``StageModule``); 0: none.
        """
        super().__init__(spec, size, vision, max_text_len, kernels, optimizer, init_from, normalization, environment_state_weight)
        self.model_config = dataclasses.replace(self.model_config, n_action_bins=n_action_bins)
        self.hparams.update({"n_action_bins": n_action_bins})

    def build_model(self) -> nn.Module:
        model = RobotTransformer(self.model_config)
        self.use_kernels(model, [model.backbone])
        return model

    def compute_loss(self, batch: dict) -> dict[str, torch.Tensor]:
        """Cross-entropy of every real action token given the observation prefix and earlier actions.

        Averaged over each sample's real tokens, then over samples. Averaging per sample first
        makes the loss of a batch the mean of the losses of its equal parts, so data-parallel
        ranks, which average their gradients, train exactly as one process on the whole batch
        even when their samples have different numbers of real tokens.
        """
        model = self.model
        text_ids, text_mask = model.text_tokenizer(batch["instruction"], device=batch["state"].device)
        targets = model.action_binner.encode(batch["actions"]).flatten(1)  # [B, horizon * action_dim]
        real = batch["action_mask"].repeat_interleave(self.spec.action_dim, dim=1)
        inputs = (batch["images"], batch["state"], text_ids, text_mask, targets)
        loss_targets = targets.masked_fill(~real, -100)
        if self.environment_state_weight:
            (loss, predicted), environment_state = model(*inputs, loss_targets=loss_targets, with_environment_state=True)
        else:
            (loss, predicted), environment_state = model(*inputs, loss_targets=loss_targets), None
        accuracy = (((predicted == targets) & real).sum(1) / real.sum(1).clamp(min=1)).mean()
        out = {"loss": loss, "token_accuracy": accuracy, "predicted_tokens": predicted, "target_tokens": targets.masked_fill(~real, -1)}
        return self.add_environment_state_loss(out, environment_state, batch)

    @property
    def tokens_per_sample(self) -> int:
        return self.model_config.seq_len

    @property
    def flops_per_sample(self) -> int:
        return training_flops_per_sample(self.model_config)
