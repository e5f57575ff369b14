"""Pretraining: next-token prediction of discretised action chunks, conditioned on images, state and language.

Research code subclasses ``PretrainModule`` and overrides one extension point (see ``base.py``):
``build_model()``, ``compute_loss(batch)``, ``build_optimizer(params)`` or ``build_scheduler(optimizer)``.
"""

from __future__ import annotations

import torch

from uma_lightning.models.contract import ACTION_BINNER, TEXT_TOKENIZER
from uma_lightning.models.network import token_network
from uma_lightning.modules.base import StageModule


class PretrainModule(StageModule):
    network_builder = staticmethod(token_network)
    key_metric = "val/token_accuracy"
    loss_reads = (TEXT_TOKENIZER, ACTION_BINNER)

    def __init__(self, n_action_bins: int = 256, **kwargs):
        """
        Args:
            n_action_bins: Each normalised action dimension is discretised into this many uniform bins.
            **kwargs: ``StageModule``'s: spec, network, optimizer, init_from, normalization.
        """
        super().__init__(**kwargs)

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
            (loss, predicted), environment_state = model(
                *inputs, loss_targets=loss_targets, with_environment_state=True
            )
        else:
            (loss, predicted), environment_state = model(*inputs, loss_targets=loss_targets), None
        accuracy = (((predicted == targets) & real).sum(1) / real.sum(1).clamp(min=1)).mean()
        out = {
            "loss": loss,
            "token_accuracy": accuracy,
            "predicted_tokens": predicted,
            "target_tokens": targets.masked_fill(~real, -1),
        }
        return self.add_environment_state_loss(out, environment_state, batch)
