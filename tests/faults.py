"""Faults injected on purpose, to prove the diagnostics catch them.

``FaultyPretrain`` is the real PretrainModule that, at chosen steps, poisons its batch with NaN,
multiplies its loss, hangs on one rank or leaks memory. ``Probe`` records, for the test to read,
the weights around chosen steps and the sample ids each batch arrived with. ``PerturbWeight`` makes
one rank's copy of a weight drift from the other replicas'.
"""

import ctypes
import errno
import io
import json
import math
import os
import signal
import threading
import time
from typing import Optional

import torch
from lightning.pytorch import Callback

from uma_lightning.modules import PretrainModule


class FaultyPretrain(PretrainModule):
    def __init__(
        self,
        *args,
        nan_at_step: Optional[int] = None,
        spike_at_step: Optional[int] = None,
        spike_factor: float = 20.0,
        hang_at_step: Optional[int] = None,
        hang_rank: int = 1,
        hang_marker: Optional[str] = None,
        leak_mib_per_step: float = 0.0,
        leak_from_step: int = 0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.nan_at_step = nan_at_step
        self.spike_at_step = spike_at_step
        self.spike_factor = spike_factor
        self.hang_at_step = hang_at_step
        self.hang_rank = hang_rank
        self.hang_marker = hang_marker
        self.leak_mib_per_step = leak_mib_per_step
        self.leak_from_step = leak_from_step
        self.trained: list[tuple[int, list[int]]] = []  # (step, sample ids) of every training_step
        self.poisoned: dict[int, list[int]] = {}
        self._leaked: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.trained.append((step, batch["sample_id"].tolist()))
        if step == self.nan_at_step and not self.poisoned:  # one batch: a rollback does not meet it again
            batch["state"] = torch.full_like(batch["state"], math.nan)
            self.poisoned[step] = batch["sample_id"].tolist()
        if step == self.hang_at_step and self.trainer.global_rank == self.hang_rank:
            with open(self.hang_marker, "w") as f:
                json.dump({"rank": self.trainer.global_rank, "time": time.time()}, f)
            time.sleep(3600)
        if self.leak_mib_per_step and step >= self.leak_from_step:
            self._leaked.append(torch.ones(int(self.leak_mib_per_step * 2**20) // 4))  # ones: the pages are touched
        return super().training_step(batch, batch_idx)

    def compute_loss(self, batch):
        out = super().compute_loss(batch)
        if self.trainer.training and self.trainer.global_step == self.spike_at_step:
            out["loss"] = out["loss"] * self.spike_factor
        return out


class Probe(Callback):
    """Weights at the start and end of ``steps`` (the first time each is reached), and those steps'
    sample ids; list it after the callback under test, whose batch-end work (a rollback) then shows
    in the weights at the end."""

    records: dict = {}  # the last run's records; class-level so a test reaches them after `uma fit` exits

    def __init__(self, steps: list[int]):
        self.steps = set(steps)
        self._current: Optional[int] = None
        Probe.records = {"before": {}, "after": {}, "global_step_after": {}, "sample_ids": {}}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps and trainer.global_step not in Probe.records["before"]:
            Probe.records["before"][trainer.global_step] = _weights(pl_module)
            Probe.records["sample_ids"][trainer.global_step] = batch["sample_id"].tolist()
            self._current = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._current is not None:
            Probe.records["after"][self._current] = _weights(pl_module)
            Probe.records["global_step_after"][self._current] = trainer.global_step
            self._current = None


class Arrivals(Callback):
    """The sample ids of every batch as the loader delivered it; list it before the callback under test."""

    records: list = []

    def __init__(self):
        Arrivals.records = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Arrivals.records.append((trainer.global_step, batch["sample_id"].tolist()))


def _weights(module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class HoldUntilSignalled(Callback):
    """Holds the run at the end of step ``at_step`` until one of ``signals`` arrives (or ``timeout_s``
    passes), so a test that signals a job once it logs that step meets it mid-training however fast it
    trains. List it after Preemption: its handler is chained, and Preemption acts at the next step."""

    def __init__(
        self, at_step: int, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT"), timeout_s: float = 120.0
    ):
        self.at_step = at_step
        self.signals = [getattr(signal, name) for name in signals]
        self.timeout_s = timeout_s
        self._signalled = threading.Event()

    def on_train_start(self, trainer, pl_module):
        for signum in self.signals:
            previous = signal.getsignal(signum)

            def chained(signum, frame, previous=previous):
                self._signalled.set()
                if callable(previous):
                    previous(signum, frame)

            signal.signal(signum, chained)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step and not self._signalled.is_set():
            # A test that waits for this line signals the run while it holds, after every earlier callback's hook.
            print(f"HoldUntilSignalled: holding after step {self.at_step}", flush=True)
            deadline = time.monotonic() + self.timeout_s
            while not self._signalled.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)  # polled: the handler that sets the event runs on this thread
            if not self._signalled.is_set():
                print(f"HoldUntilSignalled: no signal within {self.timeout_s:.0f} s of step {self.at_step}", flush=True)


class PerturbWeight(Callback):
    """Adds ``delta`` to the first element of ``parameter`` on ``rank`` after the optimizer step of
    ``step`` (once: not again after a rollback): a replica that silently drifted from the others."""

    def __init__(self, step: int, rank: int, parameter: str, delta: float = 1e-3):
        self.step, self.rank, self.parameter, self.delta = step, rank, parameter, delta
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not self.done:
            self.done = True
            weight = dict(pl_module.named_parameters())[self.parameter]
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            with torch.no_grad():
                local.view(-1)[0] += self.delta


class FaultAt(Callback):
    """Injects the fault ``kind`` on ``rank`` in training step ``step``, and first writes ``marker`` (JSON:
    rank, step, time, pid, the pids of its loader workers), from which a test times the exits:

    - ``raise``: raises at the start of the step, while the others go on into the step's collectives;
    - ``segfault``: reads address 0 in the training step (a real SIGSEGV);
    - ``worker_segfault``: sends SIGSEGV to this rank's loader worker, at the start of the step;
    - ``stop``: stops this rank with SIGSTOP (a stalled host): it neither works nor closes its connections;
    - ``kill``: kills this rank with SIGKILL (the OOM killer): it leaves no record of its own;
    - ``enospc`` / ``erofs``: from this step on, the checkpoint files this rank writes fail as on a full disk
      (the write raises ENOSPC after some bytes) or a read-only folder (the open raises EROFS). Tests run
      as root, whom neither a full quota nor ``chmod`` stops, so the error is raised where the OS would.
    """

    KINDS = ("raise", "segfault", "worker_segfault", "stop", "kill", "enospc", "erofs")

    def __init__(self, kind: str, step: int, marker: str, rank: int = 1):
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.kind, self.step, self.marker, self.rank = kind, step, marker, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        workers = _children(os.getpid())
        with open(self.marker, "w") as f:
            json.dump(
                {"rank": self.rank, "step": self.step, "time": time.time(), "pid": os.getpid(), "workers": workers}, f
            )
        if self.kind == "worker_segfault":
            for worker in workers:
                os.kill(worker, signal.SIGSEGV)
        elif self.kind in ("stop", "kill"):
            os.kill(os.getpid(), signal.SIGSTOP if self.kind == "stop" else signal.SIGKILL)
        elif self.kind in ("enospc", "erofs"):
            from uma_lightning.checkpoint import storage

            storage.open = _failing_open(errno.ENOSPC if self.kind == "enospc" else errno.EROFS)
        elif self.kind == "raise":
            raise RuntimeError(f"injected fault in step {self.step}")
        elif self.kind == "segfault":
            ctypes.string_at(0)


def _children(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        # A thread may end between the listing and the read (a checkpoint file's writer thread lives for
        # one file); it started no loader worker.
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


def _failing_open(code: int):
    """``open`` for the checkpoint writer's module: EROFS at the open, or ENOSPC at the first write."""

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[0]))

    if code == errno.EROFS:
        return fail

    class FullDisk(io.BufferedWriter):
        def write(self, data):
            fail(self.raw.name)

    def open_full(path, mode="r", buffering=-1, opener=None):
        return FullDisk(io.FileIO(path, mode, opener=opener))

    return open_full


class DamageDataAt(Callback):
    """At the start of step ``step``, truncates to half (``how="truncate"``) or deletes every data and video
    file of the dataset at ``root`` (a directory or an fsspec URL, reached with ``options``)."""

    def __init__(self, step: int, root: str, how: str, options: Optional[dict] = None):
        self.step, self.root, self.how, self.options = step, root, how, options or {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.root, **self.options)
        files = [path for path in fs.find(root) if path.endswith((".parquet", ".mp4"))]
        for path in files:
            if self.how == "delete":
                fs.rm(path)
            else:
                data = fs.cat_file(path)
                fs.pipe_file(path, data[: len(data) // 2])
        print(f"damaged ({self.how}) {len(files)} files of {self.root} at step {self.step}", flush=True)
