"""Post-training: behaviour cloning of a continuous action expert by flow matching, as pi0 does,
on top of the pretrained backbone (``models/flow.py``, ``models/flow_matching.py``).

Options, all from YAML: which parameters to freeze, LoRA adapters on chosen linear layers, and an
exponential moving average of the weights that evaluation and export use. State and action
normalisation (mean/std or quantile) is the data module's ``state_norm`` and ``action_norm``.
Overrides the same extension points as every stage (see ``base.py``).
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from typing import Any, Optional

import torch
from torch import nn

from uma_lightning.checkpoint.hf import materialise
from uma_lightning.checkpoint.weights import KeyMapping
from uma_lightning.models import ActionExpertConfig, FlowMatchingConfig
from uma_lightning.models.contract import TEXT_TOKENIZER
from uma_lightning.models.flow_matching import noisy_sample, sample_noise_and_time, velocity_loss
from uma_lightning.models.lora import LoraConfig
from uma_lightning.models.network import flow_inference_options, flow_network
from uma_lightning.modules.base import ENVIRONMENT_STATE_HEAD, StageModule
from uma_lightning.parallel.apply import reshard_data_parallel

log = logging.getLogger("uma_lightning")


class PosttrainModule(StageModule):
    # The discrete action head of earlier stages is replaced by the action expert, which starts fresh.
    key_mapping = KeyMapping(
        fresh=(
            "action_in.*",
            "action_time_mlp.*",
            "expert.*",
            "action_out.*",
            "*.lora_a",
            "*.lora_b",
            *ENVIRONMENT_STATE_HEAD,
        ),
        dropped=("action_embed.*", "action_dim_embed.*", "action_head.*", *ENVIRONMENT_STATE_HEAD),
    )

    network_builder = staticmethod(flow_network)
    loss_reads = (TEXT_TOKENIZER,)

    def __init__(
        self,
        expert: Optional[ActionExpertConfig] = None,
        flow: Optional[FlowMatchingConfig] = None,
        freeze: Optional[list[str]] = None,
        lora: Optional[LoraConfig] = None,
        ema_decay: Optional[float] = None,
        **kwargs,
    ):
        """
        Args:
            expert: Width of the action expert (its depth and heads follow the backbone).
            flow: Flow-matching time distribution, and the sampler's Euler steps and noise scale at inference.
            freeze: Glob patterns of parameter names that stop training, e.g. ``image_tokenizer.*``
                or ``backbone.layers.[01].*``.
            lora: LoRA adapters on chosen linear layers (their own weights freeze).
            ema_decay: Keep an exponential moving average of the weights with this decay, used for
                evaluation, prediction and export; None keeps none.
            **kwargs: ``StageModule``'s: spec, network, optimizer, init_from (an earlier stage whose
                tokenizers and backbone to start from; the action expert starts fresh), normalization.
        """
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
        super().__init__(**kwargs)
        as_config = lambda value, kind: kind(**value) if isinstance(value, dict) else (value or kind())  # noqa: E731
        self.expert_config = as_config(expert, ActionExpertConfig)
        self.flow = as_config(flow, FlowMatchingConfig)
        self.lora = as_config(lora, LoraConfig) if lora is not None else None
        self.freeze = list(freeze or [])
        self.ema_model: nn.Module | None = None

    # ---- extension points -------------------------------------------------------------------

    def compute_loss(self, batch: dict) -> dict[str, torch.Tensor]:
        """Flow matching: the velocity from noise to the recorded chunk, at a Beta-distributed time."""
        model = self.model
        actions = batch["actions"]
        text_ids, text_mask = model.text_tokenizer(batch["instruction"], device=actions.device)
        # Drawn per sample, keyed by the run's seed, the step and the sample's id: every layout of
        # the same global batch (one process, data-parallel slices) trains on the same draws.
        noise, t = sample_noise_and_time(
            batch["sample_id"],
            self.global_step,
            actions.shape[1:],
            self.flow,
            torch.initial_seed(),
            dtype=actions.dtype,
            device=actions.device,
        )
        noisy, target = noisy_sample(actions, noise, t)
        if self.environment_state_weight:
            velocity, environment_state = model(
                batch["images"], batch["state"], text_ids, text_mask, noisy, t, with_environment_state=True
            )
        else:
            velocity, environment_state = model(batch["images"], batch["state"], text_ids, text_mask, noisy, t), None
        return self.add_environment_state_loss(
            {"loss": velocity_loss(velocity, target, batch["action_mask"])}, environment_state, batch
        )

    # ---- model set-up: freezing, EMA ----------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        if self.freeze:
            freeze_parameters(self.model, self.freeze)
        if self.hparams.ema_decay is not None:
            self.ema_model = copy.deepcopy(self.model).requires_grad_(False)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        log.info(
            "post-training %d of %d parameters (%.1f%%)%s%s",
            trainable,
            total,
            100 * trainable / total,
            f"; LoRA rank {self.lora.rank} on {self.lora.targets}" if self.lora and self.lora.targets else "",
            f"; EMA decay {self.hparams.ema_decay} for evaluation and export" if self.ema_model is not None else "",
        )

    def initialise_weights(self, device: torch.device) -> None:
        super().initialise_weights(device)
        if self.ema_model is not None:
            # Copied from the model built on the meta device and laid out beside it: the average gets
            # its memory here, on this rank's part only, and starts as the weights just loaded.
            materialise(self.ema_model, device)
            with torch.no_grad():
                for average, current in zip(
                    [*self.ema_model.parameters(), *self.ema_model.buffers()],
                    [*self.model.parameters(), *self.model.buffers()],
                ):
                    average.copy_(current)

    def optimizer_step(self, *args, **kwargs) -> None:
        # The average moves inside the optimizer step, so that, like the weights, it changes only
        # there: checkpoints (also those written in the background) see it consistent with them.
        super().optimizer_step(*args, **kwargs)
        if self.ema_model is not None:
            self._update_ema(self.trainer.global_step)

    @torch.no_grad()
    def _update_ema(self, step: int) -> None:
        # Warm-up as in common EMA practice: early averages forget the random start quickly.
        decay = min(self.hparams.ema_decay, (1 + step) / (10 + step))
        reshard_data_parallel(self.ema_model)  # an evaluation may have left it gathered
        for average, current in zip(self.ema_model.parameters(), self.model.parameters()):
            if current.requires_grad:
                average.lerp_(current.detach(), 1.0 - decay)

    @property
    def inference_model(self) -> nn.Module:
        return self.ema_model if self.ema_model is not None else self.model

    def inference_options(self) -> dict[str, Any]:
        return flow_inference_options(self.flow)


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Stop training the parameters whose names match any glob pattern; returns their names.
    A pattern that matches nothing is an error naming it."""
    names = [name for name, _ in model.named_parameters()]
    unmatched = [pattern for pattern in patterns if not fnmatch.filter(names, pattern)]
    if unmatched:
        raise ValueError(f"freeze pattern(s) {unmatched} match no parameter (names look like {names[0]!r})")
    frozen = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return frozen
