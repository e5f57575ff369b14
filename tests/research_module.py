"""What research code looks like: PretrainModule subclasses that change only the loss, or the network."""

import dataclasses

import torch.nn.functional as F

from uma_lightning.models import RobotTransformer
from uma_lightning.modules import PretrainModule


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
        self.model_config = dataclasses.replace(self.model_config, backbone=dataclasses.replace(backbone, n_layers=backbone.n_layers + self.extra_layers))
        return RobotTransformer(self.model_config)
