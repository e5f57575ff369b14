"""Hang watchdog: a rank that makes no progress for ``timeout_s`` seconds dumps its stacks and exits.

Each rank beats a heartbeat at every training and validation batch start and end and at every
checkpoint save. A monitor thread checks it; when the heartbeat is older than ``timeout_s``, it
writes into ``<run dir>/hang/``:

- ``stacks_rank<R>.txt``: the Python stack of every thread of the rank (faulthandler);
- ``flight_recorder_rank<R>.pkl``: the rank's recent collectives from PyTorch's flight recorder
  (NCCL or gloo; which one is pending shows who is waiting for whom);
- ``event_rank<R>.json``: rank, host, pid, last step, seconds without progress;

logs the event (an error line; on global rank zero also an MLflow tag ``watchdog.hang``, the files
as artifacts under ``hang/``, and the run marked FAILED), and exits with status ``exit_code`` so a
scheduler restarts the job rather than letting it hang until its wall time. Training runs in
lockstep, so a rank that hangs soon stalls all others in their next collective, and each rank's
own watchdog dumps its stacks in turn. A rank whose collective fails first, because the hung rank
has exited and closed its connections, is part of the same incident: it dumps and exits with the
same status instead of a plain crash.

Every rank also names the fault that ended the job in one line, ``fault: rank R failed at step S:
WHAT``, the same on every rank (and as the MLflow tag ``fault``), from records each rank leaves in
``<run dir>/faults/``:

- a rank whose step raises writes ``fault_rank<R>.json`` (the exception's type and first line)
  before the exception ends it;
- a rank killed by a fatal signal (a segfault, an abort) leaves ``fatal_rank<R>.txt``, Python's fault
  handler's stack dump, whose first line names the signal;
- a rank that loses a peer in a collective waits up to ``report_wait_s`` for the peer's record and
  names it; a peer that leaves none was killed (SIGKILL, the OOM killer) or is stopped;
- a rank that times out names the ranks that have not timed out too and left no record: the ones
  stopped or stuck where their own watchdog cannot run.

If the monitor thread itself cannot run (a native call that holds the GIL), faulthandler's own
timer dumps the stacks to stderr and exits with status 1 a little later.

The flight recorder is sized when the process group is created, which happens after this callback
is built, so the constructor sets ``TORCH_FR_BUFFER_SIZE`` (and its NCCL-era name) and asks NCCL to
dump its trace on a collective timeout, unless they are set already.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.lightning_compat import mlflow_tracking_uri
from uma_lightning.tracking import find_mlflow_logger
from uma_lightning.tracking.mlflow_logger import flush_async_logging

log = logging.getLogger("uma_lightning")

MLFLOW_REPORT_TIMEOUT_S = 20.0
FAULTS_DIR = "faults"


class HangWatchdog(Callback):
    def __init__(
        self,
        timeout_s: float = 900.0,
        exit_code: int = 75,
        flight_recorder_entries: int = 2000,
        report_wait_s: float = 10.0,
    ):
        """
        Args:
            timeout_s: Seconds without a batch starting or ending after which a rank counts as hung.
                Must exceed the slowest legitimate gap: the first step (compilation), a checkpoint save.
            exit_code: Exit status of a hung rank (75, EX_TEMPFAIL: worth retrying).
            flight_recorder_entries: Collectives kept per rank by PyTorch's flight recorder (0: off).
            report_wait_s: Seconds a rank that lost a peer, or timed out, waits for the other ranks' records
                of what failed (they are written as a rank fails, so a short wait suffices).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255, got {exit_code}")
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.report_wait_s = report_wait_s
        self.poll_s = min(max(timeout_s / 20, 0.1), 5.0)
        if flight_recorder_entries > 0:
            for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
                os.environ.setdefault(name, str(flight_recorder_entries))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        self._trainer: Optional[Trainer] = None
        self._dump_dir: Optional[Path] = None
        self._faults_dir: Optional[Path] = None
        self._fatal_file = None
        self._fault_handler_was_on = False
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._dump_dir = Path(trainer.default_root_dir).resolve() / "hang"
        self._faults_dir = Path(trainer.default_root_dir).resolve() / FAULTS_DIR
        # NCCL's own dump on a collective timeout, for a timeout shorter than this watchdog's.
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(self._dump_dir / "nccl_trace_rank_"))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
        # Only once training starts: a command that stops before (a finished run) leaves the run folder as it was.
        self._faults_dir.mkdir(parents=True, exist_ok=True)
        # A previous attempt's records, and its verdict after a hang, would name a culprit of the past: each
        # rank clears its own.
        _fault_record(self._faults_dir, trainer.global_rank).unlink(missing_ok=True)
        _hang_event(self._dump_dir, trainer.global_rank).unlink(missing_ok=True)
        self._fatal_file = open(_fatal_record(self._faults_dir, trainer.global_rank), "w")
        self._fault_handler_was_on = faulthandler.is_enabled()
        faulthandler.enable(file=self._fatal_file, all_threads=True)
        self._beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="uma-hang-watchdog", daemon=True)
        self._thread.start()
        if trainer.is_global_zero:
            log.info(
                "hang watchdog: a rank without progress for %g s dumps its stacks into %s and exits with status %d",
                self.timeout_s,
                self._dump_dir,
                self.exit_code,
            )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        faulthandler.cancel_dump_traceback_later()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_fault_handler(trainer)

    def _restore_fault_handler(self, trainer: Trainer) -> None:
        """Fatal signals are reported where they were before training (Lightning skips teardown after an exception)."""
        if self._fatal_file is not None:
            if self._fault_handler_was_on:
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            else:
                faulthandler.disable()
            self._fatal_file.close()
            self._fatal_file = None
            # A run without a fatal signal leaves no empty record (nor an empty folder) behind.
            fatal = _fatal_record(self._faults_dir, trainer.global_rank)
            with contextlib.suppress(OSError):  # rmdir: other ranks' records, or theirs still to be removed
                if fatal.stat().st_size == 0:
                    fatal.unlink()
                    self._faults_dir.rmdir()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # From the start of training to the teardown: the final checkpoint's save, which fails after on_train_end
        # (Lightning calls the checkpoint callbacks' hooks last), is part of the job.
        training = self._fatal_file is not None
        self.on_train_end(trainer, pl_module)
        if training and _is_lost_peer(exception):
            self._report_and_exit(time.monotonic() - self._last_beat, cause=exception)
        elif training and not isinstance(exception, (SystemExit, KeyboardInterrupt)):  # a stop (preemption) is no fault
            # This rank is where the job failed: the others name it from this record.
            # A collective's error names the rank it failed on (a checkpoint save: the rank whose write failed).
            failed_rank = getattr(exception, "failed_rank", None)
            rank = trainer.global_rank if failed_rank is None else failed_rank
            record = {"rank": rank, "step": trainer.global_step, "fault": _first_line(exception)}
            if trainer.world_size > 1:  # alone, a process's own error line says it all
                _write_json(_fault_record(self._faults_dir, trainer.global_rank), record)
                log.error("fault: %s", _describe(record))
            tagger = threading.Thread(target=self._tag_fault, args=(_describe(record),), daemon=True)
            tagger.start()
            tagger.join(MLFLOW_REPORT_TIMEOUT_S)
        self._restore_fault_handler(trainer)

    # Progress: any of these means the rank is not stuck.
    def on_train_batch_start(self, *args) -> None:
        self._beat()

    def on_train_batch_end(self, *args) -> None:
        self._beat()

    def on_validation_batch_start(self, *args) -> None:
        self._beat()

    def on_validation_batch_end(self, *args) -> None:
        self._beat()

    def on_save_checkpoint(self, *args) -> None:
        self._beat()

    def _beat(self) -> None:
        self._last_beat = time.monotonic()

    def _watch(self) -> None:
        armed_for = None
        while not self._stop.wait(self.poll_s):
            beat = self._last_beat
            idle = time.monotonic() - beat
            if idle > self.timeout_s:
                faulthandler.cancel_dump_traceback_later()
                self._report_and_exit(idle)
            if beat != armed_for:
                # Backstop for when this thread cannot run: it fires only if not re-armed in time.
                faulthandler.dump_traceback_later(self.timeout_s + 2 * self.poll_s + 5, exit=True, file=sys.__stderr__)
                armed_for = beat

    def _report_and_exit(self, idle: float, cause: Optional[BaseException] = None) -> None:
        trainer = self._trainer
        rank = trainer.global_rank
        out = self._dump_dir
        out.mkdir(parents=True, exist_ok=True)
        event = {
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": trainer.global_step,
            "seconds_without_progress": round(idle, 1),
            "timeout_s": self.timeout_s,
            "time": time.time(),
        }
        stacks = out / f"stacks_rank{rank}.txt"
        with open(stacks, "w") as f:
            f.write(
                f"rank {rank} on {event['host']} (pid {event['pid']}): no progress for {idle:.1f} s "
                f"after step {event['step']}\n\n"
            )
            f.flush()
            if cause is not None:
                f.write("".join(traceback.format_exception(cause)) + "\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        files = [stacks]
        if dist.is_available() and dist.is_initialized():
            try:
                trace = torch._C._distributed_c10d._dump_fr_trace()
            except (AttributeError, RuntimeError) as err:
                log.error("hang: flight recorder dump failed: %s", err)
            else:
                files.append(out / f"flight_recorder_rank{rank}.pkl")
                files[-1].write_bytes(trace)
        event["files"] = [f.name for f in files]
        if cause is None:
            what = f"made no progress for {idle:.0f} s (timeout {self.timeout_s:g} s)"
        else:
            event["lost_peer"] = str(cause).splitlines()[0][:500]
            what = f"lost a peer in a collective ({type(cause).__name__})"
        _write_json(_hang_event(out, rank), event)
        event["fault"] = self._culprits(trainer, timed_out=cause is None)
        _write_json(_hang_event(out, rank), event)  # with what this rank concluded, for the others to adopt
        log.error(
            "hang: rank %d %s after step %d; stacks and collectives in %s; exiting with status %d",
            rank,
            what,
            event["step"],
            out,
            self.exit_code,
        )
        log.error("fault: %s", event["fault"])
        reporter = threading.Thread(target=self._report_to_mlflow, args=(event,), daemon=True)
        reporter.start()
        reporter.join(MLFLOW_REPORT_TIMEOUT_S)  # a tracking server that hangs too must not keep the job alive
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(self.exit_code)

    def _report_to_mlflow(self, event: dict) -> None:
        logger = find_mlflow_logger(self._trainer)
        if logger is None:
            return
        try:
            client, run_id = logger.experiment, logger.run_id
            flush_async_logging(mlflow_tracking_uri(logger))  # the metrics of the steps before the hang
            client.set_tag(run_id, "watchdog.hang", json.dumps(event))
            client.set_tag(run_id, "fault", event["fault"])
            client.log_artifacts(run_id, str(self._dump_dir), "hang")
            client.set_terminated(run_id, "FAILED")
        except Exception as err:  # reporting is best effort; exiting is what matters
            log.error("hang: could not report to MLflow: %s", err)

    def _tag_fault(self, fault: str) -> None:
        logger = find_mlflow_logger(self._trainer)
        if logger is None:
            return
        try:
            logger.experiment.set_tag(logger.run_id, "fault", fault)
        except Exception as err:  # a tracking server that is down must not hide the fault
            log.error("fault: could not tag the MLflow run: %s", err)

    def _culprits(self, trainer: Trainer, timed_out: bool) -> str:
        """What failed, from the other ranks' records: a rank's exception or fatal signal, or what a rank that
        reported first concluded; else, after a timeout, the ranks that neither timed out nor left a record."""
        others = [rank for rank in range(trainer.world_size) if rank != trainer.global_rank]
        deadline = time.monotonic() + self.report_wait_s
        while True:
            records = [record for record in (_read_record(self._faults_dir, rank) for rank in others) if record]
            if records:
                # dict: once each (every rank of a failed collective save names the same rank)
                return "; ".join(dict.fromkeys(_describe(record, trainer.global_step) for record in records))
            events = [_read_json(_hang_event(self._dump_dir, rank)) for rank in others]
            verdicts = [event["fault"] for event in events if event and "fault" in event]
            if verdicts:
                return verdicts[0]
            silent = [rank for rank, event in zip(others, events) if event is None]
            if time.monotonic() >= deadline or (timed_out and not silent):
                break
            time.sleep(0.1)
        if timed_out and not silent:
            return f"every rank made no progress for {self.timeout_s:g} s after step {trainer.global_step} (a hang)"
        culprits = silent or others
        return (
            f"rank{'s' if len(culprits) > 1 else ''} {', '.join(map(str, culprits))} failed at step "
            f"{trainer.global_step}: left no record "
            f"({'stopped, or stuck where its watchdog cannot run' if timed_out else 'killed by SIGKILL, or stopped'})"
        )


def _fault_record(faults_dir: Path, rank: int) -> Path:
    return faults_dir / f"fault_rank{rank}.json"


def _fatal_record(faults_dir: Path, rank: int) -> Path:
    return faults_dir / f"fatal_rank{rank}.txt"


def _hang_event(dump_dir: Path, rank: int) -> Path:
    return dump_dir / f"event_rank{rank}.json"


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: the other ranks read it while it is written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being written
        return None


def _read_record(faults_dir: Path, rank: int) -> Optional[dict]:
    """Rank ``rank``'s record of its fault: its exception, or the fatal signal its fault handler reported."""
    record = _read_json(_fault_record(faults_dir, rank))
    if record is not None:
        return record
    try:
        fatal = _fatal_record(faults_dir, rank).read_text().strip()
    except OSError:
        return None
    return {"rank": rank, "fault": fatal.splitlines()[0]} if fatal else None


def _describe(record: dict, step_seen: Optional[int] = None) -> str:
    """``rank R failed at step S: WHAT``; a fatal signal's record has no step: the one this rank was in."""
    return f"rank {record['rank']} failed at step {record.get('step', step_seen)}: {record['fault']}"


def _first_line(exception: BaseException) -> str:
    lines = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {lines[0][:500] if lines else ''}".rstrip(": ")


_PEER_LOSS_MARKERS = ("closed by peer", "reset by peer", "Broken pipe")


def _is_lost_peer(exception: BaseException) -> bool:
    """A collective failed because another rank went away (gloo reports it as a plain RuntimeError)."""
    return isinstance(exception, dist.DistError) or any(m in str(exception) for m in _PEER_LOSS_MARKERS)
