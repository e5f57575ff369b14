"""What every training stage shares. ``PretrainModule``, ``MidtrainModule`` and ``PosttrainModule``
subclass ``StageModule``; research code subclasses one of them and overrides one extension point:

- ``build_model()``: the ``nn.Module`` to train (called once, inside the strategy's init context);
- ``compute_loss(batch)``: a dict with the scalar ``"loss"``, any other scalars to log, and
  optionally ``"predicted_tokens"`` and ``"target_tokens"`` ([B, n] each, targets < 0 ignored), from
  which evaluation measures each sample's token accuracy, averaged over all its samples
  (``add_environment_state_loss`` adds the optional auxiliary loss to such a dict);
- ``build_optimizer(params)`` and ``build_scheduler(optimizer)``: what ``configure_optimizers`` returns.

Evaluation (``uma validate``, ``uma test``, validation during ``uma fit``) logs the loss, token
accuracy where there are tokens, and the errors of predicted action chunks in robot units (MSE and
L1 per action dimension and per chunk step). Predicted chunks come from ``policy()``, the same
``Policy`` object that ``uma predict``, closed-loop evaluation and RL actors use.

``init_from`` starts the model from another stage's checkpoint (see ``init_from.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig, convert_to_float8
from uma_lightning.models import RobotModelConfig, load_size
from uma_lightning.models.sizes import ModelSize
from uma_lightning.models.tokenizers import VisionConfig
from uma_lightning.modules.init_from import KeyMapping, check_weights, load_weights, read_checkpoint
from uma_lightning.modules.metrics import ActionError
from uma_lightning.policy import Policy

log = logging.getLogger("uma_lightning")

EVAL_STAGES = ("val", "test")


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``, stepped per optimizer step.

    Every stage starts a fresh schedule, so a stage that starts from a checkpoint warms up again.
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1


ENVIRONMENT_STATE_HEAD = ("environment_state_head.*",)


class StageModule(L.LightningModule):
    #: The metric that says how good the stage's result is, logged as ``final/...`` when training ends.
    key_metric = "val/action_mse"
    #: What may differ between this stage's model and an ``init_from`` checkpoint: the environment-state
    #: head is optional in every stage.
    key_mapping = KeyMapping(fresh=ENVIRONMENT_STATE_HEAD, dropped=ENVIRONMENT_STATE_HEAD)

    def __init__(
        self,
        spec: Optional[DataSpec] = None,
        size: ModelSize = "tiny",
        vision: Optional[VisionConfig] = None,
        max_text_len: int = 32,
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
            kernels: Implementation of each op. attention: auto, flash_attn, flash_attn_4, sdpa,
                sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math or reference; rms_norm, swiglu,
                rotary, cross_entropy: auto, triton or torch; linear: torch or float8 (torchao).
            optimizer: AdamW and learning-rate schedule settings.
            init_from: Checkpoint of an earlier stage to start from (weights only: the optimizer,
                schedule and step start afresh). None starts from random weights.
            normalization: State and action normalisation of the data (mode, offset, scale, names);
                ``uma`` links it from the data module, and checkpoints keep it for inference.
            environment_state_weight: Weight of an auxiliary loss: the mean squared error of a linear
                head on the last observation token predicting the data's (normalised) environment
                state, e.g. where the named target is. 0 builds no head. Needs data that records one.
        """
        super().__init__()
        if spec is None:
            raise ValueError(f"{type(self).__name__} needs the data spec: pass spec=datamodule.spec (uma fit links it for you)")
        self.spec = DataSpec(**spec) if isinstance(spec, dict) else spec
        if environment_state_weight < 0:
            raise ValueError(f"environment_state_weight must be >= 0, got {environment_state_weight}")
        if environment_state_weight and not self.spec.environment_state_dim:
            raise ValueError(
                f"environment_state_weight {environment_state_weight} needs data that records observation.environment_state; "
                "this data has none (or not every dataset of the mixture has it)"
            )
        self.environment_state_weight = float(environment_state_weight)
        vision = VisionConfig(**vision) if isinstance(vision, dict) else vision or VisionConfig()
        self.model_config = RobotModelConfig(
            backbone=load_size(size), spec=self.spec, vision=vision, max_text_len=max_text_len, environment_state_head=environment_state_weight > 0
        )
        self.kernels = KernelConfig(**kernels) if isinstance(kernels, dict) else kernels or KernelConfig()
        if isinstance(optimizer, dict):
            optimizer = OptimizerConfig(**optimizer)
        self.optimizer_config = optimizer or OptimizerConfig()
        self.init_from = init_from
        # Plain types only, so checkpoints load with weights_only=True and the resolved size is recorded.
        # Subclasses add their own arguments with self.hparams.update(...).
        self.save_hyperparameters(
            {
                "spec": dataclasses.asdict(self.spec),
                "size": dataclasses.asdict(self.model_config.backbone),
                "vision": dataclasses.asdict(vision),
                "max_text_len": max_text_len,
                "kernels": dataclasses.asdict(self.kernels),
                "optimizer": dataclasses.asdict(self.optimizer_config),
                "init_from": init_from,
                "normalization": normalization,
                "environment_state_weight": self.environment_state_weight,
            },
            logger=False,
        )
        self.model: nn.Module | None = None
        self.action_errors = nn.ModuleDict()
        self.token_accuracy = nn.ModuleDict()

    # ---- extension points -------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def compute_loss(self, batch: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    def add_environment_state_loss(self, out: dict[str, torch.Tensor], predicted: torch.Tensor | None, batch: dict) -> dict[str, torch.Tensor]:
        """With a prediction of the environment state ([B, dim], None without the head), add its
        weighted mean squared error to ``out["loss"]`` and report the parts (``action_loss``,
        ``environment_state_mse``: 1.0 is no better than predicting the dataset mean)."""
        if predicted is None:
            return out
        mse = F.mse_loss(predicted.float(), batch["environment_state"].float())
        return {**out, "loss": out["loss"] + self.environment_state_weight * mse, "action_loss": out["loss"].detach(), "environment_state_mse": mse.detach()}

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        cfg = self.optimizer_config
        # Matrices decay; norms, biases and position tables (ndim < 2) do not, as is standard for transformers.
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        cfg = self.optimizer_config
        total = max(int(self.trainer.estimated_stepping_batches), 1) if self._trainer is not None else 1
        warmup = min(cfg.warmup_steps, total)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def use_kernels(self, model: nn.Module, transformers: list[nn.Module]) -> None:
        """Give a freshly built model the configured op implementations; with float8 linears, convert
        the ``transformers`` (the heads stay in higher precision)."""
        model.set_kernels(self.kernels)
        if self.kernels.linear == "float8":
            for transformer in transformers:
                convert_to_float8(transformer)

    # ---- inference ------------------------------------------------------------------------------

    @property
    def inference_model(self) -> nn.Module:
        """The weights evaluation and export use (a stage with an EMA returns the average)."""
        return self.model

    def inference_options(self) -> dict[str, Any]:
        """Keyword arguments of the model's ``predict_actions`` at inference."""
        return {}

    def policy(self) -> Policy:
        """A ``Policy`` over this module's inference weights (shared, not copied)."""
        if self.hparams.normalization is None:
            raise ValueError(f"{type(self).__name__} has no normalization statistics: pass normalization=datamodule.normalization()")
        return Policy(self.inference_model, self.spec, self.hparams.normalization, self.inference_options())

    # ---- Lightning hooks ----------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.hparams.normalization is None and datamodule is not None and hasattr(datamodule, "normalization"):
            self.hparams.normalization = datamodule.normalization()
        names = (self.hparams.normalization or {}).get("action", {}).get("names") or [f"dim_{i}" for i in range(self.spec.action_dim)]
        for split in EVAL_STAGES:
            if split not in self.action_errors:
                self.action_errors[split] = ActionError(self.spec.action_horizon, names, prefix=f"{split}/")
                self.token_accuracy[split] = MeanMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = self.build_model()
        if self.init_from:
            source = read_checkpoint(self.init_from)
            load_weights(self.model, source, self.key_mapping)
            self.log_context_change(source.hparams)

    def check_init_from(self) -> None:
        """Raise ValueError listing the keys if ``init_from`` cannot initialise this stage's model;
        the model is built on the meta device for the check, which costs no memory."""
        if not self.init_from:
            return
        with torch.device("meta"):
            model = self.build_model()
        check_weights(model.state_dict(), read_checkpoint(self.init_from), self.key_mapping, type(model).__name__)

    def log_context_change(self, source_hparams: dict) -> None:
        """Say how the context (history frames, chunk length) and the rotary position range changed."""
        spec = source_hparams.get("spec")
        if not spec:
            return
        before = (spec["n_obs_steps"], spec["action_horizon"])
        after = (self.spec.n_obs_steps, self.spec.action_horizon)
        if before == after:
            return
        positions = self.model.backbone.max_seq_len
        log.info(
            "context: %d -> %d observation steps, %d -> %d-step action chunks; backbone RoPE positions 0..%d "
            "(rotary frequencies unchanged, theta %g: positions are relative, and this stage trains the new range)",
            before[0], after[0], before[1], after[1], positions - 1, self.model_config.backbone.rope_theta,
        )

    def configure_optimizers(self):
        optimizer = self.build_optimizer([p for p in self.parameters() if p.requires_grad])
        scheduler = self.build_scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.compute_loss(batch)
        batch_size = len(batch["instruction"])
        # Averaged over data-parallel ranks, so the logged loss is that of the global batch, comparable across strategies.
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=batch_size, sync_dist=True)
        self.log_dict({f"train/{k}": v for k, v in _scalars(out).items() if k != "loss"}, batch_size=batch_size)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=True, batch_size=batch_size)
        return out["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def evaluate(self, batch: dict, split: str) -> None:
        out = self.compute_loss(batch)
        scalars = _scalars(out)
        if "predicted_tokens" in out:
            # Each sample's accuracy over its real tokens, averaged over every sample of every batch and
            # process (as the loss is), in place of the per-batch value.
            scalars.pop("token_accuracy", None)
            real = out["target_tokens"] >= 0
            correct = ((out["predicted_tokens"] == out["target_tokens"]) & real).sum(1)
            self.token_accuracy[split].update(correct / real.sum(1).clamp(min=1))
            self.log(f"{split}/token_accuracy", self.token_accuracy[split])
        self.log_dict({f"{split}/{k}": v for k, v in scalars.items()}, prog_bar=True, batch_size=len(batch["instruction"]), sync_dist=True)
        policy = self.policy()
        predicted = policy.denormalize_actions(policy.predict_normalized(batch["images"], batch["state"], batch["instruction"]))
        target = policy.denormalize_actions(batch["actions"])
        self.action_errors[split].update(predicted, target, batch["action_mask"])

    def on_validation_epoch_end(self) -> None:
        self._log_action_errors("val")

    def on_test_epoch_end(self) -> None:
        self._log_action_errors("test")

    def _log_action_errors(self, split: str) -> None:
        metric = self.action_errors[split]
        if metric.update_count:
            self.log_dict(metric.compute())
        metric.reset()

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        """Predicted and recorded action chunks in robot units, with the frames they belong to."""
        policy = self.policy()
        predicted = policy.predict_normalized(batch["images"], batch["state"], batch["instruction"])
        return {
            "episode_index": batch["episode_index"],
            "frame_index": batch["frame_index"],
            "predicted_actions": policy.denormalize_actions(predicted),
            "target_actions": policy.denormalize_actions(batch["actions"]),
            "action_mask": batch["action_mask"],
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Which class to rebuild at inference (Policy.from_checkpoint), as a plain string.
        checkpoint["module_class"] = f"{type(self).__module__}.{type(self).__qualname__}"

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Always measure the norm (the first sign of divergence); clip only when the trainer asks to.
        by_norm = bool(gradient_clip_val) and gradient_clip_algorithm in (None, "norm")
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, float(gradient_clip_val) if by_norm else math.inf)
        self.log("grad_norm", grad_norm)
        if gradient_clip_val and not by_norm:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def _scalars(out: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.ndim == 0}
