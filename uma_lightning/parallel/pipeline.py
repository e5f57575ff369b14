"""Pipeline parallelism: the settings, and the schedule that runs a model's stages on the ``pp`` mesh dimension.

A model's plan (``plans/pipeline.py``) decides which layers each stage holds and builds one stage
module per stage. ``Pipeline`` puts those modules into ``torch.distributed.pipelining`` stages and a
schedule, and runs one step of it: the global batch in microbatches, forward and backward together,
each rank exchanging only activations with its neighbours. Every rank then holds the step's loss
and outputs, sent from the rank of the last stage, so what runs after the step (logging,
callbacks) is the same on every rank.

Schedules (``torch.distributed.pipelining``), by how many stages each rank holds:

- one stage per rank: GPipe (all forwards, then all backwards) and 1F1B (one forward, one backward
  in the steady state: fewer activations alive);
- ``virtual_stages`` >= 2 per rank, in a loop (rank r holds stages r, r + pp, ...): Interleaved1F1B
  and InterleavedZeroBubble (which fills the bubble with weight gradients);
- exactly 2 per rank, in a V (rank r holds stages r and 2 pp - 1 - r): ZBVZeroBubble.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

Schedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
SCHEDULE_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}
SINGLE_STAGE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble",)
ZERO_BUBBLE = (
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)  # their backward is two passes: input gradients, then weight gradients


@dataclass(frozen=True)
class PipelineConfig:
    """How the pipeline runs, under pp above one (the ``pipeline`` section of ``MeshStrategy``).

    Args:
        schedule: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (see above).
        microbatches: Microbatches each batch is cut into; None: one per pipeline rank, the fewest a schedule takes.
        virtual_stages: Stages per pipeline rank (the interleaved schedules take 2 or more, ZBVZeroBubble 2).
        split: The backbone layer each stage after the first starts at; None balances the stages' FLOPs.
    """

    schedule: Schedule = "1F1B"
    microbatches: Optional[int] = None
    virtual_stages: int = 1
    split: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_CLASSES:
            raise ValueError(f"pipeline.schedule must be one of {', '.join(SCHEDULE_CLASSES)}, got {self.schedule!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"pipeline.microbatches must be >= 1, got {self.microbatches}")
        if self.schedule in SINGLE_STAGE and self.virtual_stages != 1:
            raise ValueError(
                f"pipeline.schedule {self.schedule} runs one stage per rank, got pipeline.virtual_stages {self.virtual_stages}; use Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble"
            )
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            raise ValueError(
                f"pipeline.schedule {self.schedule} runs exactly 2 stages per rank, got pipeline.virtual_stages {self.virtual_stages}"
            )
        if self.schedule not in SINGLE_STAGE + V_SHAPED and self.virtual_stages < 2:
            raise ValueError(
                f"pipeline.schedule {self.schedule} interleaves 2 or more stages per rank, got pipeline.virtual_stages {self.virtual_stages}"
            )
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))

    def n_microbatches(self, pp: int) -> int:
        return self.microbatches or pp

    def check(self, pp: int, batch_size: int | None) -> None:
        """One-line ValueError if ``pp`` ranks cannot run this schedule on per-replica batches of ``batch_size``."""
        microbatches = self.n_microbatches(pp)
        if microbatches < pp:
            raise ValueError(
                f"pipeline.microbatches {microbatches} is fewer than the {pp} pipeline ranks: some would never have work"
            )
        if self.schedule not in SINGLE_STAGE + V_SHAPED and microbatches % pp:
            raise ValueError(
                f"pipeline.schedule {self.schedule} takes a multiple of the {pp} pipeline ranks as pipeline.microbatches, got {microbatches}"
            )
        if batch_size is not None and batch_size % microbatches:
            raise ValueError(
                f"a batch of {batch_size} samples (data.batch_size) does not divide into {microbatches} microbatches (pipeline.microbatches)"
            )

    def stage_indices(self, pp: int, rank: int) -> list[int]:
        """The stages ``rank`` of ``pp`` holds, in order."""
        if self.schedule in V_SHAPED:
            return [rank, 2 * pp - 1 - rank]
        return [rank + pp * v for v in range(self.virtual_stages)]


class Pipeline:
    """The schedule over this rank's stage modules.

    ``step`` runs the global batch through every stage; gradients are left in the parameters,
    scaled by the number of microbatches (each microbatch's loss is a mean over its samples, so
    the gradients are those of the mean over the whole batch), and put aside until
    ``restore_gradients``. Lightning's training loop clears gradients between the training step
    (where the schedule runs, forward and backward) and its backward call; the strategy's backward
    restores them. ``bubble_fraction`` is the share of the last step's schedule that the stages
    spent waiting on their neighbours, their mean.

    A schedule's stages fix their microbatches' shapes at the first step, so each batch size
    (evaluation's may differ from training's) gets stages and a schedule of its own, made when first met.

    ``moe_layers``: every mixture-of-experts layer of the whole model (name in the model -> experts),
    whichever stage holds it: the stages report their routing statistics on all of them together
    (``moe_stats.py``).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        n_stages: int,
        config: PipelineConfig,
        pp_mesh,
        device: torch.device,
        loss_fn: Callable,
        moe_layers: dict[str, int],
    ):
        self.modules, self.n_stages, self.config, self.device, self.loss_fn = modules, n_stages, config, device, loss_fn
        self.moe_layers = moe_layers
        self.pp_group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.microbatches = config.n_microbatches(self.pp)
        self.holds_first = 0 in modules
        self.holds_last = n_stages - 1 in modules
        # The rank of the pp group that holds the last stage (the loss): the last rank in a loop, rank 0 in a V.
        self.last_rank = next(rank for rank in range(self.pp) if n_stages - 1 in config.stage_indices(self.pp, rank))
        self.bubble_fraction = 0.0
        self.step_microbatches = self.microbatches  # those of the last step (evaluation's may be fewer)
        self.parameters = [p for module in modules.values() for p in module.parameters()]
        self._set_aside: list[torch.Tensor | None] = [None] * len(self.parameters)
        self._schedules: dict[
            tuple[bool, int], tuple[object, int]
        ] = {}  # (training, batch size) -> (schedule, microbatches)

    def _schedule(self, training: bool, batch_size: int):
        key = (training, batch_size)
        if key not in self._schedules:
            import torch.distributed.pipelining as pipelining

            # Evaluation batches need not divide as training's must: the most microbatches that divide them.
            microbatches = (
                self.microbatches
                if training
                else max(m for m in range(1, self.microbatches + 1) if batch_size % m == 0)
            )
            stages = [
                pipelining.PipelineStage(module, index, self.n_stages, self.device, group=self.pp_group)
                for index, module in self.modules.items()
            ]
            # Forward only, one stage per rank, every schedule runs the microbatches in order as GPipe
            # does; GPipe also takes fewer microbatches than stages, which 1F1B refuses.
            schedule_name = self.config.schedule if training or self.config.schedule not in SINGLE_STAGE else "GPipe"
            schedule_class = getattr(pipelining, SCHEDULE_CLASSES[schedule_name])
            schedule = schedule_class(
                stages[0] if self.config.schedule in SINGLE_STAGE else stages, microbatches, loss_fn=self.loss_fn
            )
            self._schedules[key] = (schedule, microbatches)
        return self._schedules[key]

    def step(
        self, first_inputs: tuple, shared: dict, target: torch.Tensor, outputs_like: Callable[[int], tuple]
    ) -> tuple[torch.Tensor, ...]:
        """Run the schedule on a batch: ``first_inputs`` feed the first stage, ``shared`` (keyword
        tensors, split like the batch) reach every stage's forward, ``target`` the loss. Returns the
        last stage's merged outputs on every rank (shaped and typed as ``outputs_like(microbatches)``)."""
        import torch.distributed as dist

        training = torch.is_grad_enabled()
        schedule, microbatches = self._schedule(training, len(target))
        self.step_microbatches = microbatches
        args = first_inputs if self.holds_first else ()
        kwargs = {"target": target, "losses": []} if self.holds_last else {}
        # The schedule accumulates into .grad: it starts from none, and what was there (the previous
        # step's gradients, which Lightning clears after this step, or earlier batches' under
        # gradient accumulation, which it keeps) is put back after.
        earlier = [p.grad for p in self.parameters] if training else []
        for p in self.parameters if training else ():
            p.grad = None
        start = time.perf_counter()
        with _WaitTimer() as timer:
            merged = (schedule.step if training else schedule.eval)(*args, **shared, **kwargs)
        elapsed = time.perf_counter() - start
        if training:
            self._set_aside = [p.grad for p in self.parameters]
            for p, grad in zip(self.parameters, earlier):
                p.grad = grad
        outputs = tuple(merged) if self.holds_last else tuple(torch.empty_like(t) for t in outputs_like(microbatches))
        for tensor in outputs:
            dist.broadcast(tensor, group=self.pp_group, group_src=self.last_rank)
        # The bubble: the share of the schedule's time a stage waits on its neighbours, averaged over the stages.
        waits = torch.tensor([timer.seconds / elapsed], dtype=torch.float64)
        dist.all_reduce(waits, group=self.pp_group)
        self.bubble_fraction = float(waits) / self.pp
        return outputs

    def restore_gradients(self) -> None:
        """Add the gradients of the last step back to the parameters (where gradients accumulate over batches, onto theirs)."""
        for p, grad in zip(self.parameters, self._set_aside):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
        self._set_aside = [None] * len(self.parameters)


class _WaitTimer:
    """Seconds spent inside the pipeline's point-to-point waits during a block.

    Every schedule waits on its sends' and receives' work handles through one function of torch's
    (the private ``schedules._wait_batch_p2p``); wrapping it for the block times how long a stage
    sits idle for its neighbours, the pipeline's bubble, without changing what the schedule runs.
    """

    def __enter__(self) -> _WaitTimer:
        import torch.distributed.pipelining.schedules as schedules

        self.seconds = 0.0
        self._original = schedules._wait_batch_p2p
        original = self._original

        def timed(works):
            start = time.perf_counter()
            try:
                return original(works)
            finally:
                self.seconds += time.perf_counter() - start

        schedules._wait_batch_p2p = timed
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed.pipelining.schedules as schedules

        schedules._wait_batch_p2p = self._original


def pipeline_of(module: nn.Module) -> Optional[Pipeline]:
    """The pipeline a LightningModule's model runs under (the pipeline plan sets ``model.pipeline``), or None."""
    return next((child.pipeline for child in module.children() if getattr(child, "pipeline", None) is not None), None)
