"""How a mixture-of-experts model spreads its tokens: per MoE layer, per training step, to the loggers.

For each MoE layer (named by its place in the model, e.g. ``backbone.layers.1``), summed over every
rank's tokens of the step's last micro-batch:

- ``moe/<layer>/tokens/expert<i>``: token choices each expert got (before any capacity drop);
- ``moe/<layer>/imbalance``: the busiest expert's choices over the mean (1 is perfect balance,
  n_experts / top_k the worst: one expert takes everything it can);
- ``moe/<layer>/router_entropy``: mean entropy of the router's normalised scores, in nats (log
  n_experts: undecided; 0: certain);
- ``moe/<layer>/dropped``: choices dropped by a capacity factor (0 when dropless);
- ``moe/<layer>/aux_loss``: the sequence-level balance loss, where one is configured.

An expert that gets no tokens for ``dead_after_steps`` steps in a row is named in a warning (once
per such stretch): it no longer learns, and its parameters are wasted. Models without MoE layers
log nothing.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.models.moe import moe_layers

log = logging.getLogger("uma_lightning")


class ExpertLoad(Callback):
    def __init__(self, dead_after_steps: int = 50, every_n_steps: int = 1) -> None:
        """
        Args:
            dead_after_steps: Warn when an expert gets no tokens for this many steps in a row.
            every_n_steps: Log the metrics every this many steps (the dead-expert count looks at every step).
        """
        if dead_after_steps < 1 or every_n_steps < 1:
            raise ValueError(f"ExpertLoad: dead_after_steps and every_n_steps must be >= 1, got {dead_after_steps} and {every_n_steps}")
        self.dead_after_steps = dead_after_steps
        self.every_n_steps = every_n_steps
        self._idle_steps: dict[str, torch.Tensor] = {}  # per layer: steps in a row each expert got nothing

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        layers = [(name.removesuffix(".ffn"), layer) for name, layer in moe_layers(pl_module) if "routed" in layer.stats]
        if not layers:
            return
        local = torch.stack([torch.cat((layer.stats["routed"].float(), layer.stats["dropped"].float().view(1))) for _, layer in layers])
        summed = trainer.strategy.reduce(local, reduce_op="sum").cpu()  # one collective for every layer
        entropy = trainer.strategy.reduce(torch.stack([layer.stats["entropy"] for _, layer in layers]), reduce_op="mean").cpu()
        metrics = {}
        for (name, layer), row, layer_entropy in zip(layers, summed, entropy):
            routed, dropped = row[:-1], row[-1]
            self._count_idle(trainer, name, routed)
            metrics[f"moe/{name}/imbalance"] = (routed.max() / routed.mean().clamp_min(1e-9)).item()
            metrics[f"moe/{name}/router_entropy"] = layer_entropy.item()
            metrics[f"moe/{name}/dropped"] = dropped.item()
            metrics.update({f"moe/{name}/tokens/expert{index}": count for index, count in enumerate(routed.tolist())})
            if "aux_loss" in layer.stats:
                metrics[f"moe/{name}/aux_loss"] = layer.stats["aux_loss"].item()
        if trainer.global_step % self.every_n_steps == 0:
            pl_module.log_dict(metrics, batch_size=1)

    def _count_idle(self, trainer: Trainer, name: str, routed: torch.Tensor) -> None:
        idle = self._idle_steps.get(name, torch.zeros_like(routed, dtype=torch.long))
        idle = torch.where(routed == 0, idle + 1, 0)
        self._idle_steps[name] = idle
        if trainer.is_global_zero:
            for expert in (idle == self.dead_after_steps).nonzero().flatten().tolist():
                log.warning(
                    "MoE layer %s: expert %d got no tokens for %d steps in a row (step %d); it is not learning",
                    name, expert, self.dead_after_steps, trainer.global_step,
                )
