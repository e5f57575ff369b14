"""Gradient anomalies: non-finite loss or gradients, and spikes in loss or gradient norm, caught
before the optimizer step of the step they happen in, then acted on.

Detection, in ``on_before_optimizer_step`` (after backward, before clipping and the update):

- non-finite: the loss or any parameter's gradient holds NaN or Inf;
- spike: the loss, or the gradient norm, lies more than a threshold of standard deviations above
  the mean of the last ``window`` normal steps (a rolling z-score, as OLMo-core's stability monitor
  does). Anomalous values stay out of the window so that one spike does not hide the next.

Each rank's loss, gradient norm and non-finite flag are summed across ranks in one small
all-reduce, so every rank reaches the same decision. The parameters responsible are named: those
with non-finite gradients, or else those whose gradient norm rose most against its own running mean.

Actions, set per kind of anomaly:

- ``warn``: log it and train on;
- ``skip``: do not call the optimizer's step, so weights and optimizer state stay as they are (the
  step counter and learning-rate schedule still advance, as in OLMo and Megatron);
- ``rollback``: skip, then reload the last checkpoint (weights, optimizer, schedule, step counter)
  and leave the offending batch's samples out of every later batch;
- ``halt``: stop training with ``TrainingHalted`` before the update (``uma fit`` exits with status 3).

Every event is logged as a warning, appended to ``<run dir>/anomalies.jsonl``, and sent to MLflow
as a metric (``anomaly/<kind>`` at its step) and an artifact ``anomalies/step<S>_<kinds>.json`` with
the step, the action, loss, gradient norm, z-scores, the batch's sample ids and the culprit parameters.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor

from uma_lightning.callbacks.rollback import roll_back
from uma_lightning.lightning_compat import set_log_step
from uma_lightning.parallel.grad_norm import gradient_norms
from uma_lightning.tracking import log_artifact, log_step_metrics

log = logging.getLogger("uma_lightning")

Action = Literal["warn", "skip", "rollback", "halt"]
SEVERITY = {"warn": 0, "skip": 1, "rollback": 2, "halt": 3}


class TrainingHalted(RuntimeError):
    """Training was stopped on purpose because of an anomaly whose action is ``halt``."""


@dataclass
class RollingZScore:
    """z-score of a value against the last ``window`` normal values."""

    window: int
    min_history: int
    values: deque = field(default_factory=deque)

    def score(self, value: float) -> Optional[float]:
        if len(self.values) < self.min_history:
            return None
        mean = sum(self.values) / len(self.values)
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))
        return (value - mean) / std if std > 0 else None

    def add(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) > self.window:
            self.values.popleft()


class GradientAnomalies(Callback):
    def __init__(
        self,
        nonfinite_action: Action = "skip",
        loss_spike_action: Action = "warn",
        grad_norm_spike_action: Action = "warn",
        loss_z_threshold: float = 6.0,
        grad_norm_z_threshold: float = 6.0,
        window: int = 128,
        min_history: int = 20,
        culprits: int = 5,
        max_rollbacks: int = 3,
    ):
        """
        Args:
            nonfinite_action: What to do when the loss or a gradient is NaN or Inf: warn, skip, rollback or halt.
            loss_spike_action: What to do on a loss spike.
            grad_norm_spike_action: What to do on a gradient-norm spike.
            loss_z_threshold: Standard deviations above the rolling mean from which a loss is a spike.
            grad_norm_z_threshold: Standard deviations above the rolling mean from which a gradient norm is a spike.
            window: Normal steps the rolling mean and deviation are taken over.
            min_history: Normal steps needed before spikes are looked for.
            culprits: Parameters named per event.
            max_rollbacks: Rollbacks allowed in one fit; the next anomaly that asks for one halts
                instead, so an anomaly that comes back after every rollback cannot loop forever.
        """
        for name, action in (
            ("nonfinite_action", nonfinite_action),
            ("loss_spike_action", loss_spike_action),
            ("grad_norm_spike_action", grad_norm_spike_action),
        ):
            if action not in SEVERITY:
                raise ValueError(f"{name} must be one of {', '.join(SEVERITY)}, got {action!r}")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {max_rollbacks}")
        if not 2 <= min_history <= window:
            raise ValueError(f"need 2 <= min_history <= window, got min_history={min_history}, window={window}")
        self.actions = {
            "nonfinite": nonfinite_action,
            "loss_spike": loss_spike_action,
            "grad_norm_spike": grad_norm_spike_action,
        }
        self.thresholds = {"loss": loss_z_threshold, "grad_norm": grad_norm_z_threshold}
        self.history = {"loss": RollingZScore(window, min_history), "grad_norm": RollingZScore(window, min_history)}
        self.culprits = culprits
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self.blocked_samples: set[int] = set()
        self._parameters: list[tuple[str, torch.nn.Parameter]] = []
        self._grad_norm_mean: Optional[torch.Tensor] = None  # running mean per parameter, on the device
        self._losses: list[torch.Tensor] = []
        self._sample_ids: list[torch.Tensor] = []
        self._skip = False
        self._rollback = False
        self._logging_step: Optional[int] = None

    # ---- state that survives a resume -----------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "blocked_samples": sorted(self.blocked_samples),
            "loss_history": list(self.history["loss"].values),
            "grad_norm_history": list(self.history["grad_norm"].values),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.blocked_samples = set(state_dict["blocked_samples"])
        for metric in ("loss", "grad_norm"):
            for value in state_dict[f"{metric}_history"]:
                self.history[metric].add(value)

    # ---- hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._parameters = [(name, p) for name, p in pl_module.named_parameters() if p.requires_grad]
        for optimizer in trainer.optimizers:
            optimizer.step = self._skippable(optimizer.step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.__dict__.pop("step", None)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self._logging_step is not None:
            # Metrics after a rollback go on the restored step's axis (Lightning advances it after each step).
            set_log_step(trainer, self._logging_step)
            self._logging_step = None
        if self.blocked_samples:
            self._leave_out_blocked(trainer, batch)
        self._sample_ids.append(batch["sample_id"])  # read only when there is an event: no host sync per step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        losses, self._losses = self._losses, []
        sample_ids, self._sample_ids = self._sample_ids, []
        named_grads = [(name, p.grad) for name, p in self._parameters if p.grad is not None]
        if not named_grads or not losses:
            return
        sharded = any(isinstance(g, DTensor) for _, g in named_grads)
        grads = [g.to_local() if isinstance(g, DTensor) else g for _, g in named_grads]
        norms = torch.stack([n.float() for n in gradient_norms(grads)])  # clipping reuses them
        loss = torch.stack(losses).float().sum()  # Lightning divides each micro-batch loss by the accumulation count
        nonfinite = (~torch.isfinite(norms)).any() | ~torch.isfinite(loss)
        summed = trainer.strategy.reduce(torch.stack([loss, norms.square().sum(), nonfinite.float()]), reduce_op="sum")
        loss_sum, squares, nonfinite_ranks = summed.tolist()  # the one host sync per step
        world = trainer.world_size
        loss_value = loss_sum / world
        # Replicated gradients (DDP) are the same on every rank of a pipeline stage; sharded ones, and
        # different stages' gradients, add up across ranks.
        copies = 1 if sharded else world // _pipeline_stages(pl_module)
        grad_norm = math.sqrt(squares / copies) if math.isfinite(squares) else squares

        kinds, scores = [], {}
        if nonfinite_ranks > 0:
            kinds.append("nonfinite")
        else:
            for metric, value in (("loss", loss_value), ("grad_norm", grad_norm)):
                z = self.history[metric].score(value)
                if z is not None:
                    scores[metric] = z
                    if z > self.thresholds[metric]:
                        kinds.append(f"{metric}_spike")
        if scores:
            log_step_metrics(trainer, {f"anomaly/{m}_z": z for m, z in scores.items()})
        if not kinds:
            self.history["loss"].add(loss_value)
            self.history["grad_norm"].add(grad_norm)
            mean = self._grad_norm_mean
            self._grad_norm_mean = norms if mean is None or mean.shape != norms.shape else 0.9 * mean + 0.1 * norms
            return
        self._handle(trainer, kinds, loss_value, grad_norm, scores, norms, named_grads, sample_ids)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self._rollback:
            return
        self._rollback = False
        anomalous_step = trainer.global_step - 1
        step = roll_back(trainer, pl_module)
        if step is None:
            log.warning("anomaly: no sharded checkpoint to roll back to yet; the step was skipped instead")
            return
        self._logging_step = step
        log.warning(
            "anomaly: rolled back from step %d to step %d; %d samples are left out from now on",
            anomalous_step,
            step,
            len(self.blocked_samples),
        )

    # ---- actions ----------------------------------------------------------------------------------

    def _handle(self, trainer: Trainer, kinds, loss, grad_norm, scores, norms, named_grads, sample_ids) -> None:
        action = max((self.actions[kind] for kind in kinds), key=SEVERITY.__getitem__)
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            log.warning("anomaly: %d rollbacks already (max_rollbacks); halting instead", self.rollbacks)
            action = "halt"
        step = trainer.global_step
        sample_ids = torch.cat(sample_ids).tolist()
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sample_ids)
            sample_ids = [i for ids in gathered for i in ids]
        event = {
            "step": step,
            "kinds": kinds,
            "action": action,
            "loss": _plain(loss),
            "grad_norm": _plain(grad_norm),
            "z_scores": scores,
            "sample_ids": sorted(sample_ids),
            "culprits": self._culprits(norms, [name for name, _ in named_grads]),
            "time": time.time(),
        }
        culprit_names = ", ".join(c["parameter"] for c in event["culprits"])
        log_step_metrics(trainer, {f"anomaly/{kind}": 1.0 for kind in kinds})
        if trainer.is_global_zero:  # every rank reached the same decision; one reports it
            log.warning(
                "anomaly at step %d: %s (loss %s, grad_norm %s); action %s; culprits: %s",
                step,
                " + ".join(kinds),
                event["loss"],
                event["grad_norm"],
                action,
                culprit_names,
            )
            self._record(trainer, event)
        if action in ("skip", "rollback"):
            self._skip = True
        if action == "rollback":
            self._rollback = True
            self.rollbacks += 1
            self.blocked_samples.update(sample_ids)
        if action == "halt":
            raise TrainingHalted(
                f"{' + '.join(kinds)} at step {step}, culprits: {culprit_names}; "
                f"details in {Path(trainer.default_root_dir) / 'anomalies.jsonl'}"
            )

    def _culprits(self, norms: torch.Tensor, names: list[str]) -> list[dict]:
        """Parameters with non-finite gradients, else those whose gradient norm grew most against its running mean."""
        bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        if bad:
            chosen = bad[: self.culprits]
        else:
            baseline = self._grad_norm_mean
            ratio = (
                norms / baseline.clamp_min(1e-12) if baseline is not None and baseline.shape == norms.shape else norms
            )
            chosen = ratio.topk(min(self.culprits, len(names))).indices.tolist()
        values = norms.tolist()
        return [{"parameter": names[i], "grad_norm": _plain(values[i])} for i in chosen]

    def _record(self, trainer: Trainer, event: dict) -> None:
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "anomalies.jsonl", "a") as journal:
            journal.write(json.dumps(event) + "\n")
        path = run_dir / "anomalies" / f"step{event['step']:07d}_{'+'.join(event['kinds'])}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(event, indent=2) + "\n")
        log_artifact(trainer, path, "anomalies")

    def _skippable(self, step):
        """``step``, made to do nothing when this step's anomaly says so.

        Lightning passes its closure (forward, backward, then on_before_optimizer_step and gradient
        clipping) to ``optimizer.step``, so the decision is only known once the closure has run:
        run it here first, then step or not. Clipping has run either way, so a skipped step still
        logs its true grad_norm.
        """

        def skippable_step(closure=None, **kwargs):
            if closure is not None:
                loss = closure()
                if not self._take_skip():
                    step(**kwargs)
                return loss
            # A precision plugin with a loss scaler runs the closure itself, then steps without one.
            return None if self._take_skip() else step(**kwargs)

        # Keeps the marks an LR scheduler leaves on the step it wraps, so it does not warn of an override.
        return functools.update_wrapper(skippable_step, step)

    def _take_skip(self) -> bool:
        skip, self._skip = self._skip, False
        return skip

    def _leave_out_blocked(self, trainer: Trainer, batch: dict) -> None:
        ids = batch["sample_id"]
        keep = ~torch.isin(ids, torch.tensor(sorted(self.blocked_samples), device=ids.device))
        n_blocked = int((~keep).sum())
        if n_blocked == 0:
            return
        if n_blocked == len(ids):
            self._skip = True  # nothing left to learn from: train on it, but do not step
            log.info("step %d: every sample of the batch is blocked; the step is skipped", trainer.global_step)
            return
        index = keep.nonzero().flatten()
        size = len(ids)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == size:
                batch[key] = value[index.to(value.device)]
            elif isinstance(value, list) and len(value) == size:
                batch[key] = [value[i] for i in index.tolist()]
        log.info("step %d: left out %d blocked samples", trainer.global_step, n_blocked)


def _pipeline_stages(pl_module: LightningModule) -> int:
    mesh = getattr(pl_module, "device_mesh", None)  # a strategy without a mesh sets none
    return mesh["pp"].size() if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 1


def _plain(value: float):
    """JSON has no NaN or Infinity; write them as strings."""
    return value if math.isfinite(value) else str(value)
