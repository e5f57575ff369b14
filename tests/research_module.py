"""What research code looks like: a PretrainModule subclass that changes only the loss."""

import torch.nn.functional as F

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
