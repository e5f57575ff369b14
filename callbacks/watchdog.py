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

If the monitor thread itself cannot run (a native call that holds the GIL), faulthandler's own
timer dumps the stacks to stderr and exits with status 1 a little later.

The flight recorder is sized when the process group is created, which happens after this callback
is built, so the constructor sets ``TORCH_FR_BUFFER_SIZE`` (and its NCCL-era name) and asks NCCL to
dump its trace on a collective timeout, unless they are set already.
"""

from __future__ import annotations

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


class HangWatchdog(Callback):
    def __init__(self, timeout_s: float = 900.0, exit_code: int = 75, flight_recorder_entries: int = 2000):
        """
        Args:
            timeout_s: Seconds without a batch starting or ending after which a rank counts as hung.
                Must exceed the slowest legitimate gap: the first step (compilation), a checkpoint save.
            exit_code: Exit status of a hung rank (75, EX_TEMPFAIL: worth retrying).
            flight_recorder_entries: Collectives kept per rank by PyTorch's flight recorder (0: off).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255, got {exit_code}")
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.poll_s = min(max(timeout_s / 20, 0.1), 5.0)
        if flight_recorder_entries > 0:
            for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
                os.environ.setdefault(name, str(flight_recorder_entries))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        self._trainer: Optional[Trainer] = None
        self._dump_dir: Optional[Path] = None
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._dump_dir = Path(trainer.default_root_dir).resolve() / "hang"
        # NCCL's own dump on a collective timeout, for a timeout shorter than this watchdog's.
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(self._dump_dir / "nccl_trace_rank_"))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
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

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        watching = self._thread is not None
        self.on_train_end(trainer, pl_module)
        if watching and _is_lost_peer(exception):
            self._report_and_exit(time.monotonic() - self._last_beat, cause=exception)

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
        (out / f"event_rank{rank}.json").write_text(json.dumps(event, indent=2) + "\n")
        log.error(
            "hang: rank %d %s after step %d; stacks and collectives in %s; exiting with status %d",
            rank,
            what,
            event["step"],
            out,
            self.exit_code,
        )
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
            client.log_artifacts(run_id, str(self._dump_dir), "hang")
            client.set_terminated(run_id, "FAILED")
        except Exception as err:  # reporting is best effort; exiting is what matters
            log.error("hang: could not report to MLflow: %s", err)


_PEER_LOSS_MARKERS = ("closed by peer", "reset by peer", "Broken pipe")


def _is_lost_peer(exception: BaseException) -> bool:
    """A collective failed because another rank went away (gloo reports it as a plain RuntimeError)."""
    return isinstance(exception, dist.DistError) or any(m in str(exception) for m in _PEER_LOSS_MARKERS)
