"""Silent corruption: the copies of each weight that data-parallel replicas hold, compared every
``every_n_steps`` optimizer steps, then acted on as ``GradientAnomalies`` acts (warn, rollback, halt).

Replicas of a weight stay bitwise equal: each applies the same all-reduced gradient with the same
optimizer. A bit flipped in memory, a faulty chip's arithmetic or a rank that loaded other weights
makes one copy drift, and nothing else notices: the all-reduce averages the gradients of models that
are no longer the same, and the drift never goes away.

The checksum of a tensor is the sum of its elements' bit patterns read as integers of their own width
(wrapping), so a change of any one element changes it, however small; it costs one read of the weights. Every
tensor's checksum goes into one vector, gathered from the replicas in one collective per check (and
a one-number all-reduce where there are several groups of replicas, so every rank acts alike). A
tensor whose checksum differs from the majority's (with two replicas, from the lower rank's) is
named with the rank that holds it.

What is compared:

- DDP (``ddp``, ``ep``, Lightning's DDPStrategy): every weight, across all data-parallel ranks; under
  ``ep`` the experts across the ranks that hold the same experts;
- HSDP (``hsdp``): each rank's shards, across the replicas (``dp_replicate``) that hold the same shards;
- FSDP, tensor parallelism and pipeline stages without ``dp_replicate``: nothing, and it is said once:
  each shard, slice or stage exists once, so there is no second copy to compare.

Checks run after the optimizer step, before the checkpoint callback of the same step: a check every
``every_n_steps`` that divides the checkpoint interval looks at the weights right before each save,
so a rollback finds a checkpoint saved before the drift.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from typing import Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor

from uma_lightning.callbacks.anomalies import TrainingHalted
from uma_lightning.callbacks.rollback import roll_back
from uma_lightning.lightning_compat import set_log_step
from uma_lightning.tracking import log_step_metrics

log = logging.getLogger("uma_lightning")

Action = Literal["warn", "rollback", "halt"]
# The integer type of each element size: a tensor's bits read as integers of its own width.
BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NAMED = 5  # tensors named per rank in a report


def weight_checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[len(tensors)] int64: each tensor's (each DTensor's local part's) elements as integers, summed."""
    sums = []
    for tensor in tensors:
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()
        bits = BITS_AS[local.element_size()]
        # Summed in their own width, wrapping: a change of one element changes the sum by less than the
        # wrap, so it always shows; and 20 times faster on a CPU than summing int32 into int64.
        sums.append(local.view(bits).sum(dtype=bits).to(torch.int64))
    return torch.stack(sums)


def shard_key(tensor: torch.Tensor) -> int:
    """Which part of a weight this rank holds: the same number on ranks whose copies must be equal."""
    if not isinstance(tensor, DTensor):
        return 0
    key, coordinate = 0, tensor.device_mesh.get_coordinate() or []
    for size, index, placement in zip(tensor.device_mesh.shape, coordinate, tensor.placements):
        if placement.is_shard():
            key = key * size + index
    return key


def differing_replicas(checksums: list[list[int]], keys: list[list[int]], names: list[str]) -> dict[int, list[str]]:
    """{replica index: names of the tensors where it differs from the majority of the replicas that hold
    the same part}, from every replica's checksums and shard keys (one row per replica). A tie goes to
    the lowest replica's value."""
    found: dict[int, list[str]] = defaultdict(list)
    for column, name in enumerate(names):
        holders = defaultdict(list)
        for replica, row in enumerate(keys):
            holders[row[column]].append(replica)
        for replicas in holders.values():
            counts = Counter(checksums[replica][column] for replica in replicas)
            majority = counts.most_common(1)[0][0]  # counted in replica order: ties go to the lowest
            for replica in replicas:
                if checksums[replica][column] != majority:
                    found[replica].append(name)
    return dict(found)


class ReplicaChecksum(Callback):
    def __init__(self, every_n_steps: int = 100, action: Action = "halt", max_rollbacks: int = 3):
        """
        Args:
            every_n_steps: Compare the replicas' weights after every this many optimizer steps.
            action: When they differ: ``warn``, ``rollback`` (every rank reloads the newest sharded
                checkpoint, which makes the replicas equal again) or ``halt`` (``uma fit`` exits with status 3).
            max_rollbacks: Rollbacks allowed in one fit; then a difference halts, since a chip that keeps
                corrupting its weights needs replacing, not another rollback.
        """
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if action not in ("warn", "rollback", "halt"):
            raise ValueError(f"action must be one of warn, rollback, halt, got {action!r}")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {max_rollbacks}")
        self.every_n_steps = every_n_steps
        self.action = action
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self._group: Optional[dist.ProcessGroup] = None
        self._parameters: list[tuple[str, torch.nn.Parameter]] = []
        self._keys: Optional[torch.Tensor] = None
        self._step_seen: Optional[int] = None
        self._logging_step: Optional[int] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._group, why_not = _replica_group(trainer, pl_module)
        if self._group is None:
            if trainer.is_global_zero:
                log.info("replica checksum: nothing is checked: %s", why_not)
            return
        self._parameters = list(pl_module.named_parameters())
        # On the device the group's backend reduces on (weights may be offloaded to the CPU).
        device = trainer.strategy.root_device
        self._keys = torch.tensor([shard_key(p) for _, p in self._parameters], dtype=torch.int64, device=device)
        self._step_seen = trainer.global_step
        if trainer.is_global_zero:
            log.info(
                "replica checksum: %d weights compared across %d replicas every %d steps (action %s)",
                len(self._parameters),
                dist.get_world_size(self._group),
                self.every_n_steps,
                self.action,
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self._logging_step is not None:
            # Metrics after a rollback go on the restored step's axis (Lightning advances it after each step).
            set_log_step(trainer, self._logging_step)
            self._logging_step = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._group is None:
            return
        stepped, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self.check(trainer, pl_module)

    def check(self, trainer: Trainer, pl_module: LightningModule) -> dict[int, list[str]]:
        """Compare now, on every rank of the job; {global rank: tensors where it differs}, and act."""
        names = [name for name, _ in self._parameters]
        checksums = weight_checksums([p for _, p in self._parameters]).to(self._keys.device)
        local = torch.stack([checksums, self._keys])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, local, group=self._group)
        rows = torch.stack(gathered).tolist()  # the one host sync of a check
        ranks = dist.get_process_group_ranks(self._group)
        found = {
            ranks[replica]: tensors
            for replica, tensors in differing_replicas([r[0] for r in rows], [r[1] for r in rows], names).items()
        }
        step = trainer.global_step
        differing = len({tensor for tensors in found.values() for tensor in tensors})
        if len(ranks) < trainer.world_size:
            # Several replica groups (HSDP, pipeline stages): every rank must act alike, or the ranks that
            # stop would leave the others waiting in their next collective. A second, one-number collective.
            anywhere = torch.tensor([differing], dtype=torch.int64, device=local.device)
            dist.all_reduce(anywhere)
            differing = int(anywhere.item())
        log_step_metrics(trainer, {"replica/differing_tensors": float(differing)})
        if not differing:
            return found
        report = (
            "; ".join(
                f"rank {rank} differs from the other replicas in {len(tensors)} weight(s): {', '.join(tensors[:NAMED])}"
                + (", ..." if len(tensors) > NAMED else "")
                for rank, tensors in sorted(found.items())
            )
            or "the replicas of another group differ (its lowest rank names them)"
        )
        action = self.action
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action = "halt"
            report += f" ({self.rollbacks} rollbacks already: max_rollbacks)"
        if found and trainer.global_rank == min(ranks):  # every replica reached the same finding; one reports it
            log.error("replica checksum after step %d: %s; action %s", step, report, action)
        if action == "halt":
            raise TrainingHalted(f"replicated weights differ after step {step}: {report}")
        if action == "rollback":
            self.rollbacks += 1
            restored = roll_back(trainer, pl_module)
            if restored is None:
                raise TrainingHalted(
                    f"replicated weights differ after step {step} and there is no checkpoint: {report}"
                )
            self._logging_step = self._step_seen = restored
            if trainer.is_global_zero:
                log.warning("replica checksum: rolled back from step %d to step %d", step, restored)
        return found


def _replica_group(trainer: Trainer, pl_module: LightningModule) -> tuple[Optional[dist.ProcessGroup], str]:
    """The process group whose ranks hold copies of the same weights, or None and why there is none."""
    if trainer.world_size == 1:
        return None, "one process, no replicas"
    mesh = getattr(pl_module, "device_mesh", None)
    if mesh is not None:
        try:
            replicas = mesh["dp_replicate"]  # a dimension of the mesh, or flattened from two (under ep)
        except KeyError:
            return None, f"the device mesh {mesh.mesh_dim_names} has no dp_replicate dimension"
        if replicas.size() == 1:
            return None, (
                "dp_replicate is 1: FSDP shards, tensor-parallel slices and pipeline stages each exist once, "
                "so no weight has a second copy (HSDP's dp_replicate replicas would be compared)"
            )
        return replicas.get_group(), ""
    if isinstance(trainer.strategy, DDPStrategy):
        return dist.group.WORLD, ""
    return None, f"{type(trainer.strategy).__name__} keeps no replicas this callback knows of"
