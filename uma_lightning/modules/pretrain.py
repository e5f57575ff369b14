"""Pretraining: next-token prediction of discretised action chunks, conditioned on images, state and language.

Research code subclasses ``PretrainModule`` and overrides one extension point:

- ``build_model()``: the ``nn.Module`` to train (called once, inside the strategy's init context);
- ``compute_loss(batch)``: a dict with the scalar ``"loss"`` and any extra metrics to log;
- ``build_optimizer(params)`` and ``build_scheduler(optimizer)``: what ``configure_optimizers`` returns.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig, convert_to_float8
from uma_lightning.models import RobotModelConfig, RobotTransformer, load_size, training_flops_per_sample
from uma_lightning.models.sizes import ModelSize


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``, stepped per optimizer step."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1


class PretrainModule(L.LightningModule):
    def __init__(
        self,
        spec: DataSpec | None = None,
        size: ModelSize = "tiny",
        patch_size: int = 8,
        max_text_len: int = 32,
        n_action_bins: int = 256,
        kernels: KernelConfig | None = None,
        optimizer: OptimizerConfig | None = None,
    ):
        """
        Args:
            spec: Data shapes the model is built for; ``uma fit`` links it from the data module.
            size: Backbone size: a preset name (tiny, small, 1b, 7b), a YAML file, or a dict of dimensions.
            patch_size: Camera frames are cut into square patches of this many pixels.
            max_text_len: Instructions are cut or padded to this many UTF-8 bytes.
            n_action_bins: Each normalised action dimension is discretised into this many uniform bins.
            kernels: Implementation of each op. attention: auto, flash_attn, flash_attn_4, sdpa,
                sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math or reference; rms_norm, swiglu,
                rotary, cross_entropy: auto, triton or torch; linear: torch or float8 (torchao).
            optimizer: AdamW and learning-rate schedule settings.
        """
        super().__init__()
        if spec is None:
            raise ValueError("PretrainModule needs the data spec: pass spec=datamodule.spec (uma fit links it for you)")
        self.spec = DataSpec(**spec) if isinstance(spec, dict) else spec
        self.model_config = RobotModelConfig(
            backbone=load_size(size),
            spec=self.spec,
            patch_size=patch_size,
            max_text_len=max_text_len,
            n_action_bins=n_action_bins,
        )
        self.kernels = KernelConfig(**kernels) if isinstance(kernels, dict) else kernels or KernelConfig()
        self.optimizer_config = optimizer or OptimizerConfig()
        # Plain types only, so checkpoints load with weights_only=True and the resolved size is recorded.
        self.save_hyperparameters(
            {
                "spec": dataclasses.asdict(self.spec),
                "size": dataclasses.asdict(self.model_config.backbone),
                "patch_size": patch_size,
                "max_text_len": max_text_len,
                "n_action_bins": n_action_bins,
                "kernels": dataclasses.asdict(self.kernels),
                "optimizer": dataclasses.asdict(self.optimizer_config),
            },
            logger=False,
        )
        self.model: nn.Module | None = None

    # ---- extension points -------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = RobotTransformer(self.model_config)
        model.set_kernels(self.kernels)
        if self.kernels.linear == "float8":
            convert_to_float8(model.backbone)  # the action head stays in higher precision
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
        loss, predicted = model(batch["images"], batch["state"], text_ids, text_mask, targets, loss_targets=targets.masked_fill(~real, -100))
        accuracy = (((predicted == targets) & real).sum(1) / real.sum(1).clamp(min=1)).mean()
        return {"loss": loss, "token_accuracy": accuracy}

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

    # ---- Lightning hooks ----------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build_model()

    def configure_optimizers(self):
        optimizer = self.build_optimizer([p for p in self.parameters() if p.requires_grad])
        scheduler = self.build_scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.compute_loss(batch)
        batch_size = len(batch["instruction"])
        # Averaged over data-parallel ranks, so the logged loss is that of the global batch, comparable across strategies.
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=batch_size, sync_dist=True)
        self.log_dict({f"train/{k}": v for k, v in out.items() if k != "loss"}, batch_size=batch_size)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=True, batch_size=batch_size)
        return out["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self.compute_loss(batch)
        self.log_dict({f"val/{k}": v for k, v in out.items()}, prog_bar=True, batch_size=len(batch["instruction"]), sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Always measure the norm (the first sign of divergence); clip only when the trainer asks to.
        by_norm = bool(gradient_clip_val) and gradient_clip_algorithm in (None, "norm")
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, float(gradient_clip_val) if by_norm else math.inf)
        self.log("grad_norm", grad_norm)
        if gradient_clip_val and not by_norm:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ---- facts about the model other components report --------------------------------------

    @property
    def tokens_per_sample(self) -> int:
        return self.model_config.seq_len

    @property
    def flops_per_sample(self) -> int:
        return training_flops_per_sample(self.model_config)
