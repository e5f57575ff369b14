"""What every training stage shares. ``PretrainModule``, ``MidtrainModule`` and ``PosttrainModule``
subclass ``StageModule``; research code subclasses one of them and overrides one extension point:

- ``build_model()``: the ``nn.Module`` to train (called once, inside the strategy's init context), any
  network that has what the run's features call (``models/contract.py``, checked by ``uma fit``);
- ``compute_loss(batch)``: a dict with the scalar ``"loss"``, any other scalars to log, and
  optionally ``"predicted_tokens"`` and ``"target_tokens"`` ([B, n] each, targets < 0 ignored), from
  which evaluation measures each sample's token accuracy, averaged over all its samples
  (``add_environment_state_loss`` adds the optional auxiliary loss to such a dict);
- ``build_optimizer(params)`` and ``build_scheduler(optimizer)``: what ``configure_optimizers`` returns.

Settings are grouped by concern, and each is declared once, in its section's dataclass:

- ``network``: ``NetworkConfig`` (``models/network.py``): size, vision, max_text_len, kernels,
  environment_state_weight; the same in every stage;
- ``optimizer``: ``OptimizerConfig`` below;
- ``init_from``: the checkpoint of an earlier stage to start from (weights only);
- ``spec`` and ``normalization``: linked from the data module by ``uma fit``.

A stage adds only its own arguments and passes the rest on as ``**kwargs`` (the CLI resolves them
through to this class), e.g. ``PretrainModule(n_action_bins=256, **kwargs)``; a recipe reads
``model.init_args.network.size``, ``model.init_args.optimizer.lr``, ``model.init_args.n_action_bins``.
Checkpoints save every constructor argument of the class actually trained, a research subclass's
own included, as plain values, and name the function that builds its network from them
(``network_builder``), so ``Policy.from_checkpoint`` rebuilds exactly that network without the
module class, unless the class overrides ``build_model`` (then the class is imported and rebuilt
with the saved arguments).

Evaluation (``uma validate``, ``uma test``, validation during ``uma fit``) logs the loss, token
accuracy where there are tokens, and the errors of predicted action chunks in robot units (MSE and
L1 per action dimension and per chunk step). Predicted chunks come from ``policy()``, the same
``Policy`` object that ``uma predict``, closed-loop evaluation and RL actors use.

``init_from`` starts the model from another stage's checkpoint (see ``checkpoint/weights.py``), or
a network holding a ``transformers`` model from a Hugging Face directory (``checkpoint/hf.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from uma_lightning.checkpoint.hf import (
    check_hf_weights,
    is_hf_directory,
    load_hf_weights,
    materialise,
    read_hf_directory,
)
from uma_lightning.checkpoint.weights import KeyMapping, check_weights, load_weights, read_checkpoint
from uma_lightning.data.spec import DataSpec
from uma_lightning.hyperparameters import constructor_arguments, plain
from uma_lightning.models.contract import FEATURES, Piece, contract_problems
from uma_lightning.models.moe import ExpertBalancing
from uma_lightning.models.network import FLAT_NETWORK_KEYS, NetworkConfig, grouped_settings, network_of, use_kernels
from uma_lightning.models.sizes import load_size
from uma_lightning.modules.flops import FlopCountError, batch_size_of, count_training_flops
from uma_lightning.modules.metrics import ActionError, log_reduced
from uma_lightning.parallel.grad_norm import clip_grad_norm
from uma_lightning.parallel.moe_stats import sum_per_moe_layer
from uma_lightning.parallel.pipeline import pipeline_of
from uma_lightning.policy import Policy

log = logging.getLogger("uma_lightning")

EVAL_STAGES = ("val", "test")


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``, stepped per optimizer step.

    Every stage starts a fresh schedule, so a stage that starts from a checkpoint warms up again.

    Args:
        lr: Peak learning rate, reached after the warmup.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's moment coefficients.
        eps: AdamW's epsilon.
        warmup_steps: Optimizer steps of linear warmup from 0.
        min_lr_ratio: The cosine decays to this fraction of lr at the last step.
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
    #: Builds this stage's network from its hyperparameters (a function of ``models/network.py``).
    network_builder: ClassVar[Optional[Callable]] = None
    #: What this class's ``compute_loss`` reads from the network beside its forward (see
    #: ``models/contract.py``); a subclass that overrides ``compute_loss`` reads what it declares.
    loss_reads: ClassVar[tuple[Piece, ...]] = ()
    #: Arguments of earlier versions that moved into a section: old name -> new key.
    moved_settings: ClassVar[dict[str, str]] = {key: f"network.{key}" for key in FLAT_NETWORK_KEYS}

    def __init__(
        self,
        spec: Optional[DataSpec] = None,
        network: Optional[NetworkConfig] = None,
        optimizer: Optional[OptimizerConfig] = None,
        init_from: Optional[str] = None,
        normalization: Optional[dict] = None,
    ):
        """
        Args:
            spec: Data shapes the model is built for; ``uma fit`` links it from the data module.
            network: What the network is: size, vision, max_text_len, kernels, environment_state_weight
                (see ``NetworkConfig``).
            optimizer: AdamW and learning-rate schedule settings.
            init_from: Checkpoint of an earlier stage to start from (weights only: the optimizer,
                schedule and step start afresh), or a Hugging Face model directory (``config.json`` and
                safetensors) for a network that holds a ``transformers`` model. None starts from random weights.
            normalization: State and action normalisation of the data (mode, offset, scale, names);
                ``uma`` links it from the data module, and checkpoints keep it for inference.
        """
        super().__init__()
        if spec is None:
            raise ValueError(
                f"{type(self).__name__} needs the data spec: pass spec=datamodule.spec (uma fit links it for you)"
            )
        self.spec = DataSpec(**spec) if isinstance(spec, dict) else spec
        self.network = network_of({"network": network})
        self.environment_state_weight = self.network.environment_state_weight
        self.network.check_data(self.spec)
        self.kernels = self.network.kernels
        self.optimizer_config = (
            OptimizerConfig(**optimizer) if isinstance(optimizer, dict) else optimizer or OptimizerConfig()
        )
        self.init_from = init_from
        # The resolved size is recorded, so a checkpoint does not depend on the preset files.
        network = {**plain(self.network), "size": dataclasses.asdict(load_size(self.network.size))}
        resolved = {"spec": plain(self.spec), "network": network, "optimizer": plain(self.optimizer_config)}
        self.save_hyperparameters(
            {**constructor_arguments(inspect.currentframe(), StageModule), **resolved}, logger=False
        )
        self.model: nn.Module | None = None
        self.weights_pending = False  # the model waits for its weights until the strategy has laid it out
        self.action_errors = nn.ModuleDict()
        self.token_accuracy = nn.ModuleDict()
        self.expert_balancing = ExpertBalancing()  # of mixture-of-experts layers; nothing without them
        #: Training FLOPs of one sample, counted from the first batch (``count_flops_per_sample``).
        self.flops_per_sample: int | None = None
        self.flops_problem: str | None = None  # why they could not be counted

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's ``load_from_checkpoint``, for checkpoint files saved before the network settings
        were grouped too: their flat ``size``, ``vision``, ... are moved into ``network`` first."""
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
        hparams = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {}
        if any(key in hparams for key in FLAT_NETWORK_KEYS):
            checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = grouped_settings(hparams)
            checkpoint_path = io.BytesIO()
            torch.save(checkpoint, checkpoint_path)
            checkpoint_path.seek(0)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ---- extension points -------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        if self.network_builder is None:
            raise NotImplementedError(f"{type(self).__name__} must implement build_model() or set network_builder")
        return self.network_builder(self.hparams)[0]

    def compute_loss(self, batch: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    def add_environment_state_loss(
        self, out: dict[str, torch.Tensor], predicted: torch.Tensor | None, batch: dict
    ) -> dict[str, torch.Tensor]:
        """With a prediction of the environment state ([B, dim], None without the head), add its
        weighted mean squared error to ``out["loss"]`` and report the parts (``action_loss``,
        ``environment_state_mse``: 1.0 is no better than predicting the dataset mean)."""
        if predicted is None:
            return out
        dtype = torch.promote_types(
            predicted.dtype, torch.float32
        )  # at least float32; float64 (uma parity) stays float64
        mse = F.mse_loss(predicted.to(dtype), batch["environment_state"].to(dtype))
        return {
            **out,
            "loss": out["loss"] + self.environment_state_weight * mse,
            "action_loss": out["loss"].detach(),
            "environment_state_mse": mse.detach(),
        }

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
        """Give a freshly built model the configured op implementations (see ``models/network.py``)."""
        use_kernels(model, self.kernels, transformers)

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
            raise ValueError(
                f"{type(self).__name__} has no normalization statistics: pass normalization=datamodule.normalization()"
            )
        return Policy(self.inference_model, self.spec, self.hparams.normalization, self.inference_options())

    # ---- Lightning hooks ----------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.hparams.normalization is None and datamodule is not None and hasattr(datamodule, "normalization"):
            self.hparams.normalization = datamodule.normalization()
        names = (self.hparams.normalization or {}).get("action", {}).get("names") or [
            f"dim_{i}" for i in range(self.spec.action_dim)
        ]
        for split in EVAL_STAGES:
            if split not in self.action_errors:
                self.action_errors[split] = ActionError(self.spec.action_horizon, names, prefix=f"{split}/")
                self.token_accuracy[split] = MeanMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = self.build_model()
        strategy = self._trainer.strategy if self._trainer is not None else None
        # A network that leaves parameters on the meta device (a pretrained model's, built from its
        # config) gets their memory and weights after a sharding strategy has laid it out, on this
        # rank's part only; otherwise here, whole.
        self.weights_pending = self.loads_weights_after_layout() and getattr(strategy, "shards_parameters", False)
        if not self.weights_pending:
            self.initialise_weights(torch.empty(0).device)

    def loads_weights_after_layout(self) -> bool:
        """Whether the weights this stage starts from can be loaded into the laid-out model: those of
        a Hugging Face directory (``network.pretrained``, or ``init_from`` naming one) can, shard by
        shard; one of our checkpoints is loaded into the whole model."""
        return not self.init_from or is_hf_directory(self.init_from)

    def initialise_weights(self, device: torch.device) -> None:
        """Give the model's parameters left on the meta device memory on ``device``, then load the
        weights it starts from: ``init_from``'s, or else the pretrained model's the network names
        (``pretrained_weights()``). Called on the built model, or by the strategy after its layout."""
        materialise(self.model, device)
        self.weights_pending = False
        pretrained = getattr(self.model, "pretrained_weights", None)
        if self.init_from and is_hf_directory(self.init_from):
            load_hf_weights(self.model, read_hf_directory(self.init_from))
        elif self.init_from:
            source = read_checkpoint(self.init_from)
            load_weights(self.model, source, self.key_mapping)
            self.log_context_change(source.hparams)
        elif callable(pretrained):
            load_hf_weights(self.model, read_hf_directory(pretrained()))

    def network_problems(self, features: list[str]) -> dict[str, list[str]]:
        """What the network lacks of the model contract (``models/contract.py``) for ``features``
        (names in ``FEATURES``): each problem, with the features that need the piece. The network is
        built on the meta device for the check, which costs no memory."""
        with torch.device("meta"):
            network = self.build_model()
        needs = {feature: FEATURES[feature] for feature in features}
        loss_owner = next(klass for klass in type(self).__mro__ if "compute_loss" in vars(klass))
        if "training" in needs:
            needs["training"] = needs["training"] + vars(loss_owner).get("loss_reads", ())
        return contract_problems(network, needs, self.inference_options())

    def check_init_from(self) -> None:
        """Raise ValueError listing the keys if ``init_from`` (without it: the ``network.pretrained``
        directory) cannot initialise this stage's model; the model is built on the meta device for
        the check, which costs no memory."""
        if not self.init_from and not self.network.pretrained:
            return
        with torch.device("meta"):
            model = self.build_model()
        if not self.init_from:
            check_hf_weights(model, read_hf_directory(model.pretrained_weights()))
        elif is_hf_directory(self.init_from):
            check_hf_weights(model, read_hf_directory(self.init_from))
        else:
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
        context = f"context: {before[0]} -> {after[0]} observation steps, {before[1]} -> {after[1]}-step action chunks"
        backbone = getattr(self.model, "backbone", None)
        if not hasattr(backbone, "max_seq_len"):
            log.info("%s", context)  # a network of its own: no rotary positions of ours to describe
            return
        log.info(
            "%s; backbone RoPE positions 0..%d (rotary frequencies unchanged, theta %g: positions are relative, "
            "and this stage trains the new range)",
            context,
            backbone.max_seq_len - 1,
            backbone.cfg.rope_theta,
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

    def on_after_backward(self) -> None:
        self.expert_balancing.record(self)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.expert_balancing.update(self, lambda routed: sum_per_moe_layer(routed, self, self.trainer.strategy))

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
        self.log_dict(
            {f"{split}/{k}": v for k, v in scalars.items()},
            prog_bar=True,
            batch_size=len(batch["instruction"]),
            sync_dist=True,
        )
        if pipeline_of(self) is not None or _splits_sequences(self):
            # Under pp a rank holds only its stages; under tp sequence parallelism cannot split the one token
            # a decoding step adds. Predicted chunks are left out (said in the plan's log line).
            return
        policy = self.policy()
        predicted = policy.denormalize_actions(
            policy.predict_normalized(batch["images"], batch["state"], batch["instruction"])
        )
        target = policy.denormalize_actions(batch["actions"])
        self.action_errors[split].update(predicted, target, batch["action_mask"])

    def on_validation_epoch_end(self) -> None:
        self._log_action_errors("val")

    def on_test_epoch_end(self) -> None:
        self._log_action_errors("test")

    def _log_action_errors(self, split: str) -> None:
        metric = self.action_errors[split]
        if metric.update_count:
            log_reduced(self, metric.compute())
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

    # ---- facts about the network that throughput, tracking and the planner report ------------

    @property
    def tokens_per_sample(self) -> Optional[int]:
        """The network's ``tokens_per_sample``, where it declares one (the model contract's optional piece)."""
        return getattr(self.model, "tokens_per_sample", None)

    def count_flops_per_sample(self, batch: dict) -> Optional[int]:
        """FLOPs of one sample's forward and backward, counted by torch's flop counter over one
        training step on ``batch`` with the network on fake tensors (``modules/flops.py``). Counted
        on the first call (throughput, tracking and ``uma plan`` call it), then the same figure every
        call; None, said once, where the step cannot be counted."""
        if self.flops_per_sample is None and self.flops_problem is None:
            try:
                flops, how = count_training_flops(self, batch)
                self.flops_per_sample = max(round(flops / batch_size_of(batch)), 1)
                say = log.info if self._trainer is None or self.trainer.is_global_zero else log.debug
                say(
                    "FLOPs: %.4g per sample, forward and backward of %s's network, counted by torch's flop counter %s",
                    self.flops_per_sample,
                    type(self).__name__,
                    how,
                )
            except FlopCountError as err:
                self.flops_problem = str(err)
                log.warning("FLOPs off for this network: its training step cannot be counted (%s); no MFU", err)
        return self.flops_per_sample

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Which class to rebuild at inference (Policy.from_checkpoint), as a plain string.
        checkpoint["module_class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        builder = recorded_builder(type(self))
        if builder is not None:
            checkpoint["network_builder"] = builder

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Always measure the norm (the first sign of divergence); clip only when the trainer asks to.
        by_norm = bool(gradient_clip_val) and gradient_clip_algorithm in (None, "norm")
        params = [p for p in self.parameters() if p.grad is not None]
        # Across meshes (with expert parallelism, experts and the other parameters are laid out on
        # different ones) and pipeline stages.
        grad_norm = clip_grad_norm(params, float(gradient_clip_val) if by_norm else math.inf, self.device_mesh)
        self.log("grad_norm", grad_norm)
        if gradient_clip_val and not by_norm:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def recorded_builder(cls: type) -> Optional[str]:
    """``"module:function"`` of the function that builds ``cls``'s network from its hyperparameters, or
    None where a subclass overrides how the network is built or run (inference then imports the class)."""
    for klass in cls.__mro__:
        if "network_builder" in vars(klass):
            builder = klass.network_builder
            return f"{builder.__module__}:{builder.__qualname__}" if builder is not None else None
        if {"build_model", "inference_options"} & set(vars(klass)):
            return None
    return None


def _scalars(out: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.ndim == 0}


def _splits_sequences(module: L.LightningModule) -> bool:
    """Whether the module runs tensor (and so sequence) parallel: a tp dimension above 1 in its mesh."""
    mesh = getattr(module, "_device_mesh", None)
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1
