"""torch.profiler on a schedule of training steps; traces and tables go to the run directory and MLflow.

Adding this callback is the one line that turns profiling on (``configs/trainer/profile.yaml``, or
``--trainer.callbacks+=uma_lightning.callbacks.ProfilerTraces`` on the command line). After
``skip_first`` steps, each cycle waits ``wait`` steps, warms up for ``warmup`` and records
``active``; ``repeat`` cycles (0: until training ends). Each rank's recorded window of training
steps FIRST to LAST gets a folder of its own, ``<run dir>/profiler/rank<R>-steps<FIRST>-<LAST>/``, with:

- ``<host>_<pid>.<ms>.pt.trace.json``: a Chrome trace, named as ``torch.profiler.tensorboard_trace_handler``
  names them (worker ``<host>_<pid>``, then the time in milliseconds), which is the file TensorBoard's
  profiler plugin (torch-tb-profiler) looks for, one run per folder: ``tensorboard --logdir <run dir>/profiler``.
  It opens as it is in https://ui.perfetto.dev or chrome://tracing;
- ``key_averages.txt``: the operators sorted by their own time;
- on a GPU, for the first window, ``memory_snapshot.pickle``: every CUDA allocation with its stack
  (drag it onto https://pytorch.org/memory_viz).

Global rank zero uploads its folders as MLflow artifacts under ``profiler/``; the other ranks' folders
stay in the run directory.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from uma_lightning.tracking import log_artifact

log = logging.getLogger("uma_lightning")


class ProfilerTraces(Callback):
    def __init__(
        self,
        skip_first: int = 10,
        wait: int = 0,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = True,
        profile_memory: bool = True,
        with_stack: bool = False,
        memory_snapshot: bool = True,
        table_rows: int = 50,
    ):
        """
        Args:
            skip_first: Training steps before the first cycle (start-up is not steady state).
            wait: Steps of each cycle that are not recorded.
            warmup: Steps of each cycle recorded and thrown away (the profiler's own start-up).
            active: Steps of each cycle recorded into a trace.
            repeat: Cycles to record; 0 records until training ends.
            record_shapes: Record the input shapes of each operator.
            profile_memory: Record tensor allocations and frees.
            with_stack: Record Python stacks per operator (larger traces, more overhead).
            memory_snapshot: On a GPU, also record a CUDA memory snapshot over the first window.
            table_rows: Rows of the key-averages table.
        """
        for name, value, least in (
            ("skip_first", skip_first, 0),
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 0),
        ):
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self.schedule = dict(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.memory_snapshot = memory_snapshot
        self.table_rows = table_rows
        self._profiler: Optional[profile] = None
        self._trainer: Optional[Trainer] = None
        self._out_dir: Optional[Path] = None
        self._recording_memory = False
        self._first_recorded_step: Optional[int] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
        self._out_dir = Path(trainer.default_root_dir) / "profiler"
        self._out_dir.mkdir(parents=True, exist_ok=True)
        on_cuda = pl_module.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        self._profiler = profile(
            activities=activities, schedule=schedule(**self.schedule), on_trace_ready=self._save, **self.options
        )
        self._profiler.start()
        self.memory_snapshot = self.memory_snapshot and on_cuda
        if trainer.is_global_zero:
            log.info(
                "profiler: %s, traces in %s", ", ".join(f"{k} {v}" for k, v in self.schedule.items()), self._out_dir
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        recording = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        if (
            self._profiler is not None
            and self._first_recorded_step is None
            and self._profiler.current_action in recording
        ):
            self._first_recorded_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        if (
            self.memory_snapshot
            and not self._recording_memory
            and self._profiler.current_action == ProfilerAction.WARMUP
        ):
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._recording_memory = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._profiler is not None:
            self._profiler.stop()  # saves a window cut short by the end of training
            self._profiler = None
        self._stop_memory_history()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def _save(self, prof: profile) -> None:
        trainer = self._trainer
        # Called when the window's last step has ended (or training has), so global_step is one past it.
        last = trainer.global_step - 1
        first = last if self._first_recorded_step is None else self._first_recorded_step
        self._first_recorded_step = None
        folder = self._out_dir / f"rank{trainer.global_rank}-steps{first}-{last}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns() // 1_000_000}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        on_cuda = ProfilerActivity.CUDA in prof.activities
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if on_cuda else "self_cpu_time_total", row_limit=self.table_rows
        )
        (folder / "key_averages.txt").write_text(table + "\n")
        if self._recording_memory:
            torch.cuda.memory._dump_snapshot(str(folder / "memory_snapshot.pickle"))
            self._stop_memory_history()
            self.memory_snapshot = False
        log_artifact(trainer, folder, f"profiler/{folder.name}")
        if trainer.is_global_zero:
            log.info("profiler: wrote %s (%s)", folder, ", ".join(sorted(p.name for p in folder.iterdir())))

    def _stop_memory_history(self) -> None:
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
