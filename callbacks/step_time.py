"""Where each training step's time goes: data wait, forward, backward, optimizer step, communication.

Phases are cut at Lightning's hooks:

    overhead    end of the previous batch -> the loop asks the loader for the next one (loggers, other
                callbacks' batch-end work, the loop's own bookkeeping)
    data_wait   the loop asks for the batch -> on_train_batch_start (waiting for the loader, moving the
                batch to the device); also logged as a fraction of the whole step, batch end to batch
                end, the number to watch for input-bound training
    forward     on_train_batch_start -> on_before_backward (training_step, zero_grad)
    backward    on_before_backward -> on_after_backward (DDP's gradient all-reduce overlaps it)
    optimizer   on_after_backward -> on_train_batch_end (clipping, optimizer and scheduler step)
    comm        summed time of DDP's gradient-bucket all-reduces, from issue to completion
    pipeline_bubble_fraction   under pipeline parallelism, the share of the schedule's time (forward
                and backward of every microbatch, inside the forward phase) that the stages spend
                waiting on their neighbours, averaged over the stages (``parallel/pipeline.py``)

On a GPU the compute phases are CUDA events, so they measure the device, not the host's kernel
launches; they are read one batch later, when they have completed, so the callback never stalls
the host. The loader is timed through the training loop's fetch hooks (the ones Lightning's profiler
uses, action ``train_dataloader_next``). A gap that contains validation or a checkpoint save reports
no overhead or fraction, and the first batch of an epoch (worker start-up) none at all. Communication
is separated only under Lightning's DDPStrategy (through a comm hook on DistributedDataParallel);
with another strategy (the mesh strategies' per-block replicate or FSDP included), or when DDP
already has a comm hook, the log says so once and it stays inside the phases above.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from uma_lightning.lightning_compat import fetch_hook, log_step, set_fetch_hook
from uma_lightning.parallel.pipeline import pipeline_of
from uma_lightning.tracking import log_step_metrics

log = logging.getLogger("uma_lightning")

Mark = Union[float, torch.cuda.Event]


def _mark(on_cuda: bool) -> Mark:
    if on_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start: Mark, end: Mark) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


@dataclass
class _CommTimer:
    """State of the DDP comm hook: one (start, end) pair per all-reduced bucket."""

    process_group: object
    on_cuda: bool
    spans: list = field(default_factory=list)

    def take(self) -> list:
        spans, self.spans = self.spans, []
        return spans


def _timed_allreduce(state: _CommTimer, bucket):  # DDP checks a return annotation, which postponed ones break
    start = _mark(state.on_cuda)

    def finished(future: torch.futures.Future) -> torch.Tensor:
        state.spans.append((start, _mark(state.on_cuda)))
        return future.value()

    return default_hooks.allreduce_hook(state.process_group, bucket).then(finished)


@dataclass
class _Step:
    log_step: int
    marks: dict
    data_wait: Optional[float]
    overhead: Optional[float]  # None when the gap before the step held validation, a save or an epoch start
    comm: list
    bubble: Optional[float]  # pipeline bubble fraction; None without a pipeline


class StepTimeBreakdown(Callback):
    def __init__(self, separate_communication: bool = True):
        """
        Args:
            separate_communication: Time DDP's gradient all-reduces through a comm hook.
        """
        self.separate_communication = separate_communication
        self._on_cuda = False
        self._comm: Optional[_CommTimer] = None
        self._previous_end: Optional[float] = None
        self._fetch_start: Optional[float] = None
        self._interrupted = False
        self._marks: dict = {}
        self._data_wait: Optional[float] = None
        self._overhead: Optional[float] = None
        self._pending: Optional[_Step] = None
        # Running totals over the steps whose data wait is known, for the whole run's wait share.
        self.total_data_wait = 0.0
        self.total_step = 0.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._on_cuda = pl_module.device.type == "cuda"
        if self.separate_communication and trainer.world_size > 1:
            self._comm = self._register_comm_hook(trainer)

    def _register_comm_hook(self, trainer: Trainer) -> Optional[_CommTimer]:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            log.info(
                "step time: communication is not separated under %s (only DDP's is)", type(trainer.strategy).__name__
            )
            return None
        timer = _CommTimer(model.process_group, self._on_cuda)
        try:
            model.register_comm_hook(timer, _timed_allreduce)
        except RuntimeError:
            log.info("step time: communication is not separated: DDP already has a comm hook")
            return None
        return timer

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        clean = self._previous_end is not None and not self._interrupted
        # Without the loop's fetch hook (another Lightning version) the whole gap counts as data wait.
        fetch_start = self._fetch_start or (self._previous_end if clean else None)
        self._data_wait = now - fetch_start if self._previous_end is not None and fetch_start is not None else None
        self._overhead = fetch_start - self._previous_end if clean else None
        self._fetch_start = None
        self._interrupted = False
        self._marks = {"start": _mark(self._on_cuda)}

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._marks.setdefault("backward_start", _mark(self._on_cuda))

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks["backward_end"] = _mark(self._on_cuda)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._marks["end"] = _mark(self._on_cuda)
        pipeline = pipeline_of(pl_module)
        step = _Step(
            log_step(trainer),
            self._marks,
            self._data_wait,
            self._overhead,
            self._comm.take() if self._comm else [],
            pipeline.bubble_fraction if pipeline else None,
        )
        if self._on_cuda:
            ready, self._pending = self._pending, step
        else:
            ready = step
        if ready is not None:
            self._report(trainer, ready)
        self._previous_end = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:
            self._report(trainer, self._pending)
            self._pending = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._interrupted = True

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new epoch restarts the loader (worker start-up): not steady-state data wait.
        self._previous_end = None
        self._time_fetches(trainer)

    def _time_fetches(self, trainer: Trainer) -> None:
        """Note when the loop starts fetching each batch, through the hook it calls for its profiler."""
        before_fetch = fetch_hook(trainer)
        if before_fetch is None:
            log.info("step time: this Lightning version has no fetch hook; data wait includes the time between steps")
            return
        if getattr(before_fetch, "step_time_breakdown", None) is self:
            return

        def on_before_fetch() -> None:
            self._fetch_start = time.perf_counter()
            before_fetch()

        on_before_fetch.step_time_breakdown = self
        set_fetch_hook(trainer, on_before_fetch)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self._interrupted = True

    def _report(self, trainer: Trainer, step: _Step) -> None:
        marks = step.marks
        if "backward_start" not in marks or "backward_end" not in marks:
            return  # training_step returned None: nothing was run backward
        if self._on_cuda:
            for event in [marks["end"], *(end for _, end in step.comm)]:
                event.synchronize()
        metrics = {
            "time/forward_ms": 1e3 * _seconds(marks["start"], marks["backward_start"]),
            "time/backward_ms": 1e3 * _seconds(marks["backward_start"], marks["backward_end"]),
            "time/optimizer_ms": 1e3 * _seconds(marks["backward_end"], marks["end"]),
        }
        if step.data_wait is not None:
            metrics["time/data_wait_ms"] = 1e3 * step.data_wait
        if step.data_wait is not None and step.overhead is not None:
            whole = step.overhead + step.data_wait + _seconds(marks["start"], marks["end"])
            self.total_data_wait += step.data_wait
            self.total_step += whole
            metrics["time/overhead_ms"] = 1e3 * step.overhead
            metrics["time/data_wait_fraction"] = step.data_wait / whole
        if step.bubble is not None:
            metrics["time/pipeline_bubble_fraction"] = step.bubble
        if self._comm is not None:
            metrics["time/comm_ms"] = 1e3 * sum(_seconds(start, end) for start, end in step.comm)
        log_step_metrics(trainer, metrics, step.log_step)
