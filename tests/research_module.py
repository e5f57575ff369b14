"""What research code looks like: PretrainModule subclasses that change only the loss, or the network;
a model with a head of its own, and that head's parallel plan; a network that is not our transformer."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from uma_lightning.models import RobotFlowTransformer, RobotTransformer
from uma_lightning.models.network import robot_model_config
from uma_lightning.models.tokenizers import ByteTokenizer
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
        cfg = robot_model_config(self.hparams, n_action_bins=self.hparams.n_action_bins)
        deeper = dataclasses.replace(cfg.backbone, n_layers=cfg.backbone.n_layers + self.extra_layers)
        return RobotTransformer(dataclasses.replace(cfg, backbone=deeper))


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


class TemporalConvNet(nn.Module):
    """A researcher's own network, not our transformer: each camera frame pooled by a strided
    convolution, a temporal convolution over the observation steps (frames, state and the mean of
    the instruction's byte embeddings), and an MLP head that regresses the whole action chunk.
    It has what training needs (a forward and a tokenizer for its own loss), not ``predict_actions``."""

    def __init__(self, spec, width: int = 16, max_text_len: int = 16):
        super().__init__()
        self.horizon, self.action_dim = spec.action_horizon, spec.action_dim
        self.text_tokenizer = ByteTokenizer(max_text_len)
        self.text_embed = nn.Embedding(ByteTokenizer.vocab_size, width)
        self.frame = nn.Conv2d(3, width, kernel_size=4, stride=4)
        self.state = nn.Linear(spec.state_dim, width)
        features = width * (len(spec.cameras) + 2)
        self.temporal = nn.Conv1d(features, width, kernel_size=min(2, spec.n_obs_steps))
        self.head = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, self.horizon * self.action_dim)
        )

    def forward(self, images, state, text_ids, text_mask):
        """Normalised action chunks [B, horizon, action_dim]."""
        batch, steps, cameras = images.shape[:3]
        dtype = self.state.weight.dtype  # the parameters' dtype (float64 under uma parity), not float32
        frames = images.flatten(0, 2).permute(0, 3, 1, 2).to(dtype) / 255
        pooled = self.frame(frames).mean((2, 3)).view(batch, steps, -1)
        weights = text_mask.unsqueeze(-1).to(dtype)
        text = (self.text_embed(text_ids) * weights).sum(1) / weights.sum(1).clamp(min=1)
        per_step = torch.cat((pooled, self.state(state), text.unsqueeze(1).expand(-1, steps, -1)), dim=-1)
        hidden = self.temporal(per_step.transpose(1, 2))[..., -1]  # the window ending at the newest step
        return self.head(hidden).view(batch, self.horizon, self.action_dim)


class TemporalConvPolicy(TemporalConvNet):
    """The same network with the piece evaluation and ``Policy`` call."""

    def predict_actions(self, images, state, text_ids, text_mask):
        return self.forward(images, state, text_ids, text_mask)


class TemporalConvPretrain(PretrainModule):
    """Trains ``TemporalConvPolicy`` by regressing the recorded chunk: mean squared error over real steps."""

    network_class = TemporalConvPolicy

    def __init__(self, width: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.width = width

    def build_model(self):
        return self.network_class(self.spec, self.width)

    def compute_loss(self, batch):
        model = self.model
        text_ids, text_mask = model.text_tokenizer(batch["instruction"], device=batch["state"].device)
        predicted = model(batch["images"], batch["state"], text_ids, text_mask)
        real = batch["action_mask"].unsqueeze(-1).to(predicted.dtype)
        squared = (predicted - batch["actions"].to(predicted.dtype)) ** 2 * real
        return {"loss": squared.sum() / (real.sum() * predicted.shape[-1]).clamp(min=1)}


class TemporalConvWithoutPolicy(TemporalConvPretrain):
    """The same training, on the network without ``predict_actions``."""

    network_class = TemporalConvNet
