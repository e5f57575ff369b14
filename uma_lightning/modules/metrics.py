"""Evaluation metrics of predicted action chunks, as torchmetrics (summed across processes on compute)."""

from __future__ import annotations

import re
import warnings

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torchmetrics import Metric


def log_reduced(module: LightningModule, values: dict[str, torch.Tensor]) -> None:
    """Log values that every process already holds reduced over all processes, such as a torchmetrics
    ``compute()`` (which syncs its states first). Lightning cannot tell and warns, once per name and
    process, to pass ``sync_dist=True``, which would all-reduce each value again for nothing: that
    warning is silenced for these names alone."""
    for name in values:
        warnings.filterwarnings(
            "ignore", message=re.escape(f"It is recommended to use `self.log({name!r}, "), category=PossibleUserWarning
        )
    module.log_dict(values)


class ActionError(Metric):
    """Mean squared and absolute error of predicted action chunks, per action dimension and per step
    of the chunk, over the real (unpadded) steps.

    ``compute()`` returns a dict of scalars named by ``prefix``: ``{prefix}action_mse`` and
    ``{prefix}action_l1`` over everything, ``{prefix}action_mse/<dimension name>`` (all steps of
    the chunk), and ``{prefix}action_mse/step_<k>`` (all dimensions at chunk step k).
    """

    full_state_update = False

    def __init__(self, horizon: int, dimension_names: list[str], prefix: str = ""):
        super().__init__()
        self.dimension_names = list(dimension_names)
        self.prefix = prefix
        shape = (horizon, len(self.dimension_names))
        self.add_state("squared", default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("absolute", default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros(shape[0], dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """predicted and target [B, horizon, D] in the same units; mask [B, horizon] True on real steps."""
        if predicted.shape != target.shape or predicted.shape[1:] != self.squared.shape:
            raise ValueError(
                f"predicted {tuple(predicted.shape)} and target {tuple(target.shape)} must both be [B, {self.squared.shape[0]}, {self.squared.shape[1]}]"
            )
        real = (
            torch.ones(predicted.shape[:2], dtype=torch.bool, device=predicted.device) if mask is None else mask.bool()
        )
        error = (predicted.double() - target.double()) * real[..., None]
        self.squared += error.pow(2).sum(dim=0)
        self.absolute += error.abs().sum(dim=0)
        self.count += real.sum(dim=0)

    def compute(self) -> dict[str, torch.Tensor]:
        steps = self.count.clamp(min=1)[:, None]
        total = self.count.sum().clamp(min=1)
        mse = self.squared / steps
        out = {
            f"{self.prefix}action_mse": self.squared.sum() / (total * mse.shape[1]),
            f"{self.prefix}action_l1": self.absolute.sum() / (total * mse.shape[1]),
        }
        for index, name in enumerate(self.dimension_names):
            out[f"{self.prefix}action_mse/{name}"] = self.squared[:, index].sum() / total
            out[f"{self.prefix}action_l1/{name}"] = self.absolute[:, index].sum() / total
        for step in range(mse.shape[0]):
            out[f"{self.prefix}action_mse/step_{step}"] = mse[step].mean()
        return {name: value.float() for name, value in out.items()}
