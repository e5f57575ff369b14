"""A module with a classic data-parallel bug, to check that `uma parity` catches and locates it."""

import torch.nn.functional as F

from uma_lightning.modules import PretrainModule


class TokenMeanPretrain(PretrainModule):
    """Averages the loss over the batch's real tokens. Data-parallel ranks average their losses
    with equal weights, so when their slices hold different numbers of real tokens (samples near
    an episode's end), the gradient differs from that of one process on the whole batch."""

    def compute_loss(self, batch):
        model = self.model
        text_ids, text_mask = model.text_tokenizer(batch["instruction"])
        targets = model.action_binner.encode(batch["actions"]).flatten(1)
        logits = model(batch["images"], batch["state"], text_ids, text_mask, targets)
        real = batch["action_mask"].repeat_interleave(self.spec.action_dim, dim=1)
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        return {"loss": (losses * real).sum() / real.sum()}
