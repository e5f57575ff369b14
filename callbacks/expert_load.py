"""How a mixture-of-experts model spreads its tokens: per MoE layer, per training step, to the loggers.

For each MoE layer (named by its place in the model, e.g. ``backbone.layers.1``), summed over every
rank's tokens of the step's last micro-batch (under pipeline parallelism: over every microbatch of
the schedule's step, from whichever stage holds the layer):

- ``moe/<layer>/tokens/expert<i>``: token choices each expert got (before any capacity drop);
- ``moe/<layer>/imbalance``: the busiest expert's choices over the mean (1 is perfect balance,
  n_experts / top_k the worst: one expert takes everything it can);
- ``moe/<layer>/router_entropy``: mean entropy of the router's normalised scores, in nats (log
  n_experts: undecided; 0: certain), over the ranks;
- ``moe/<layer>/dropped``: choices dropped by a capacity factor (0 when dropless);
- ``moe/<layer>/aux_loss``: the sequence-level balance loss, where one is configured (the ranks' mean).

An expert that gets no tokens for ``dead_after_steps`` steps in a row is named in a warning (once
per such stretch): it no longer learns, and its parameters are wasted. Models without MoE layers
log nothing.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.models.moe import moe_layers
from uma_lightning.parallel.moe_stats import sum_per_moe_layer

log = logging.getLogger("uma_lightning")


# After each layer's counts: dropped, entropy, 1 (summed: the ranks that added an entropy), aux loss, 1 where there is one.
EXTRA_COLUMNS = 5


def _row(stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """A layer's statistics as one row: its counts, then the EXTRA_COLUMNS."""
    aux_loss = [float(stats["aux_loss"]), 1.0] if "aux_loss" in stats else [0.0, 0.0]
    extra = torch.tensor([float(stats["dropped"]), float(stats["entropy"]), 1.0, *aux_loss], dtype=torch.float64)
    return torch.cat((stats["routed"].double().cpu(), extra))


class ExpertLoad(Callback):
    def __init__(self, dead_after_steps: int = 50, every_n_steps: int = 1) -> None:
        """
        Args:
            dead_after_steps: Warn when an expert gets no tokens for this many steps in a row.
            every_n_steps: Log the metrics every this many steps (the dead-expert count looks at every step).
        """
        if dead_after_steps < 1 or every_n_steps < 1:
            raise ValueError(
                f"ExpertLoad: dead_after_steps and every_n_steps must be >= 1, got {dead_after_steps} and {every_n_steps}"
            )
        self.dead_after_steps = dead_after_steps
        self.every_n_steps = every_n_steps
        self._idle_steps: dict[str, torch.Tensor] = {}  # per layer: steps in a row each expert got nothing

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        metrics = self.step_metrics(trainer, pl_module)
        if metrics and trainer.global_step % self.every_n_steps == 0:
            pl_module.log_dict(metrics, batch_size=1)

    def step_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """The step's metrics of every MoE layer, on every rank (a collective), counting idle experts."""
        rows = {name: _row(layer.stats) for name, layer in moe_layers(pl_module) if "routed" in layer.stats}
        summed = sum_per_moe_layer(
            rows, pl_module, trainer.strategy, extra_columns=EXTRA_COLUMNS
        )  # one collective for every layer, every stage's
        metrics = {}
        for name, row in summed.items():
            name = name.removesuffix(".ffn")
            routed, (dropped, entropy, ranks, aux_loss, ranks_with_aux_loss) = (
                row[:-EXTRA_COLUMNS],
                row[-EXTRA_COLUMNS:].tolist(),
            )
            if not ranks:
                continue  # no rank ran the layer in this step
            self._count_idle(trainer, name, routed)
            metrics[f"moe/{name}/imbalance"] = (routed.max() / routed.mean().clamp_min(1e-9)).item()
            metrics[f"moe/{name}/router_entropy"] = entropy / ranks
            metrics[f"moe/{name}/dropped"] = dropped
            metrics.update({f"moe/{name}/tokens/expert{index}": count for index, count in enumerate(routed.tolist())})
            if ranks_with_aux_loss:
                metrics[f"moe/{name}/aux_loss"] = aux_loss / ranks_with_aux_loss
        return metrics

    def _count_idle(self, trainer: Trainer, name: str, routed: torch.Tensor) -> None:
        idle = self._idle_steps.get(name, torch.zeros_like(routed, dtype=torch.long))
        idle = torch.where(routed == 0, idle + 1, 0)
        self._idle_steps[name] = idle
        if trainer.is_global_zero:
            for expert in (idle == self.dead_after_steps).nonzero().flatten().tolist():
                log.warning(
                    "MoE layer %s: expert %d got no tokens for %d steps in a row (step %d); it is not learning",
                    name,
                    expert,
                    self.dead_after_steps,
                    trainer.global_step,
                )
