"""What research code looks like: PretrainModule subclasses that change only the loss, or the network;
a model with a head of its own, and that head's parallel plan."""

import dataclasses

import torch.nn.functional as F
from torch import nn

from uma_lightning.models import RobotFlowTransformer, RobotTransformer
from uma_lightning.modules import PretrainModule
from uma_lightning.parallel import HeadPlan, register_head, replicated


class LabelSmoothedPretrain(PretrainModule):
    def __init__(self, *args, smoothing: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
        self.smoothing = smoothing
        self.loss_calls = 0

    def compute_loss(self, batch):
        self.loss_calls += 1
        out = super().compute_loss(batch)
        model = self.model
        text_ids, text_mask = model.text_tokenizer(batch["instruction"])
        targets = model.action_binner.encode(batch["actions"]).flatten(1)
        logits = model(batch["images"], batch["state"], text_ids, text_mask, targets)
        smoothed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=self.smoothing)
        return {"loss": smoothed, "plain_loss": out["loss"]}


class DeeperPretrain(PretrainModule):
    """Research code that changes the network: ``extra_layers`` more backbone layers than the size says."""

    def __init__(self, extra_layers: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.extra_layers = extra_layers

    def build_model(self):
        backbone = self.model_config.backbone
        self.model_config = dataclasses.replace(
            self.model_config, backbone=dataclasses.replace(backbone, n_layers=backbone.n_layers + self.extra_layers)
        )
        return RobotTransformer(self.model_config)


class ProgressRobot(RobotFlowTransformer):
    """Research code that adds a head: the task's progress, a scalar per sample, read from the last
    prefix token by a small MLP of its own. Its parallel plan is the three lines registered below."""

    def __init__(self, cfg, expert=None):
        super().__init__(cfg, expert)
        dim = cfg.backbone.dim
        self.progress_head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, images, state, text_ids, text_mask, noisy_actions, t):
        """(velocity [B, horizon, action_dim], progress [B])."""
        hidden, cache = self.encode_prefix(images, state, text_ids, text_mask)
        return self.velocity(cache, noisy_actions, t), self.progress_head(hidden[:, -1]).squeeze(-1)


# Wrapped on its own under FSDP and DDP, replicated under tensor parallelism.
register_head(
    ProgressRobot,
    HeadPlan("progress", blocks=lambda model: [model.progress_head], tp_layout=replicated("progress_head")),
)
