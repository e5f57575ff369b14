"""Preemption: on SIGTERM or SIGUSR1, save a checkpoint at the next step boundary and exit.

Slurm sends SIGUSR1 ahead of the time limit when asked to (``#SBATCH --signal=USR1@120``) and SIGTERM
on preemption or ``scancel``; Kubernetes sends SIGTERM. The handler only records the signal; at the
end of the current optimizer step the ranks agree that one of them got it, the ``ShardedCheckpoint``
saves and waits for the commit, and the process exits with status 128 + the signal number. With
Lightning's Slurm auto-requeue (on by default under Slurm), the requeue signal (SIGUSR1) also
requeues the job with ``scontrol requeue``, as Lightning's own handler would, so the job restarts
and resumes from that checkpoint. If no step boundary comes within the grace period (a hung step),
the process requeues when it should and exits without saving; the last periodic checkpoint remains.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer

from uma_lightning.callbacks.checkpointing import ShardedCheckpoint
from uma_lightning.lightning_compat import cluster_environment

log = logging.getLogger("uma_lightning")


class Preemption(Callback):
    def __init__(self, grace_period_s: float = 90.0, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")):
        """
        Args:
            grace_period_s: Seconds from the signal within which the save must be committed; keep it
                below the time Slurm or Kubernetes gives before SIGKILL.
            signals: Signal names that trigger a save and exit.
        """
        if grace_period_s <= 0:
            raise ValueError(f"grace_period_s must be > 0, got {grace_period_s}")
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal name(s) {unknown}; use names such as SIGTERM or SIGUSR1")
        self.grace_period_s = grace_period_s
        self.signals = [getattr(signal, name) for name in signals]
        self._received: Optional[int] = None
        self._timer: Optional[threading.Timer] = None
        self._previous_handlers: dict[int, object] = {}
        self._group: Optional[dist.ProcessGroup] = None
        self._trainer: Optional[Trainer] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
        if trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            # Replaces Lightning's SIGTERM handler, which would stop training without saving.
            self._previous_handlers = {signum: signal.signal(signum, self._on_signal) for signum in self.signals}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        signum = self._agreed_signal()
        if not signum:
            return
        name = signal.Signals(signum).name
        checkpoint = next((cb for cb in trainer.callbacks if isinstance(cb, ShardedCheckpoint)), None)
        if checkpoint is None:
            log.warning("%s: no ShardedCheckpoint callback, exiting without saving", name)
        else:
            checkpoint.save(trainer, pl_module, wait=True)
        self._cancel_timer()
        self._requeue_if_asked(signum)
        log.info("%s: checkpoint of step %d committed, exiting", name, trainer.global_step)
        raise SystemExit(128 + signum)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._cancel_timer()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self._received is not None:
            return
        self._received = signum
        log.info("received %s: saving a checkpoint at the next step boundary, then exiting (grace period %.0f s)",
                 signal.Signals(signum).name, self.grace_period_s)
        self._timer = threading.Timer(self.grace_period_s, self._grace_period_over, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _agreed_signal(self) -> int:
        """The signal any rank received (the same answer on every rank), or 0."""
        received = torch.tensor([self._received or 0])
        if self._group is not None:
            dist.all_reduce(received, op=dist.ReduceOp.MAX, group=self._group)
        return int(received)

    def _grace_period_over(self, signum: int) -> None:
        log.error("%s: no step boundary within the %.0f s grace period; exiting without a new checkpoint",
                  signal.Signals(signum).name, self.grace_period_s)
        self._requeue_if_asked(signum)
        os._exit(128 + signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _requeue_if_asked(self, signum: int) -> None:
        trainer = self._trainer
        environment = cluster_environment(trainer)
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue and signum == environment.requeue_signal):
            return
        if not trainer.is_global_zero:
            return
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
        try:
            result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.error("could not requeue Slurm job %s: %s", job_id, err)
            return
        if result.returncode == 0:
            log.info("requeued Slurm job %s", job_id)
        else:
            log.error("scontrol requeue %s failed (%d): %s", job_id, result.returncode, result.stderr.strip())
