"""Preemption: on SIGTERM, SIGUSR1 or SIGINT, save a checkpoint at the next step boundary and exit.

Slurm sends SIGUSR1 ahead of the time limit when asked to (``#SBATCH --signal=USR1@120``) and SIGTERM
on preemption, ``scancel`` or ``scontrol requeue``; Kubernetes sends SIGTERM; a terminal sends SIGINT.
The handler only records the signal, and only in the process that installed it (loader workers and
RL actors ignore these signals, see ``uma_lightning.stop_signals``). At the end of the current
optimizer step the ranks agree that one of them got it, the ``ShardedCheckpoint`` saves and waits
for the commit, and ``Preempted`` is raised: Lightning tears down (loader workers, loggers) and
``uma`` then exits with status 128 + the signal number. With Lightning's Slurm auto-requeue (on by
default under Slurm), the requeue signal (SIGUSR1) also requeues the job with ``scontrol requeue``,
as Lightning's own handler would, as the very last thing: Slurm cancels the job's processes as soon
as it requeues, so everything else must be done by then. If no step boundary comes, or teardown
does not end, within the grace period (a hung step), the process requeues when it should and exits
at once; the last periodic checkpoint remains. A second Ctrl+C stops without waiting.
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
from uma_lightning.stop_signals import ignore_stop_signals

log = logging.getLogger("uma_lightning")


class Preempted(SystemExit):
    """Raised once the checkpoint is committed; its code is the exit status, 128 + the signal number.
    Whoever catches it after the trainer has torn down calls ``finish()``, which requeues the Slurm
    job if that was asked for and exits (``uma`` does; a script of its own should too)."""

    def __init__(self, signum: int, requeue_job: Optional[str], timer: Optional[threading.Timer]):
        super().__init__(128 + signum)
        self.signum, self.requeue_job, self.timer = signum, requeue_job, timer

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        # Slurm signals every process of the job again once it is requeued; this one is done.
        ignore_stop_signals()
        if self.requeue_job is not None:
            requeue(self.requeue_job)
        raise SystemExit(self.code)


class Preemption(Callback):
    def __init__(self, grace_period_s: float = 25.0, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")):
        """
        Args:
            grace_period_s: Seconds from the signal within which the save must be committed and the
                trainer torn down; keep it below the time the scheduler gives before SIGKILL (Slurm's
                ``KillWait`` and Kubernetes' ``terminationGracePeriodSeconds``, both 30 s by default).
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
        self._pid = os.getpid()
        self._committed = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
        if trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            # Replaces Lightning's SIGTERM handler, which would stop training without saving.
            self._pid = os.getpid()
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
        self._committed = True
        log.info("%s: checkpoint of step %d committed, exiting with status %d", name, trainer.global_step, 128 + signum)
        # The grace timer keeps running: it also bounds the teardown that follows.
        raise Preempted(signum, self._requeue_job(signum), self._timer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._cancel_timer()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _on_signal(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            return  # a child forked before it set its own handlers
        if self._received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl+C twice: stop without waiting for the checkpoint
            return
        self._received = signum
        # Said from another thread: this handler may have interrupted a write to the very stream the line
        # goes to (a pipe's write retried after EINTR runs it), which refuses a reentrant write.
        threading.Thread(target=self._announce, args=(signum,), name="preemption-notice", daemon=True).start()
        self._timer = threading.Timer(self.grace_period_s, self._grace_period_over, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _announce(self, signum: int) -> None:
        log.info(
            "received %s: saving a checkpoint at the next step boundary, then exiting (grace period %.0f s)",
            signal.Signals(signum).name,
            self.grace_period_s,
        )

    def _agreed_signal(self) -> int:
        """The signal any rank received (the same answer on every rank), or 0."""
        received = torch.tensor([self._received or 0])
        if self._group is not None:
            dist.all_reduce(received, op=dist.ReduceOp.MAX, group=self._group)
        return int(received)

    def _grace_period_over(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._committed:
            log.error("%s: teardown did not end within the %.0f s grace period; exiting now", name, self.grace_period_s)
        else:
            log.error(
                "%s: no step boundary within the %.0f s grace period; exiting without a new checkpoint",
                name,
                self.grace_period_s,
            )
        job = self._requeue_job(signum)
        if job is not None:
            requeue(job)
        os._exit(128 + signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _requeue_job(self, signum: int) -> Optional[str]:
        """The Slurm job to requeue after ``signum``, on global rank zero; None when none is."""
        trainer = self._trainer
        environment = cluster_environment(trainer)
        if not (
            isinstance(environment, SLURMEnvironment)
            and environment.auto_requeue
            and signum == environment.requeue_signal
        ):
            return None
        if not trainer.is_global_zero:
            return None
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]


def requeue(job_id: str) -> None:
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("could not requeue Slurm job %s: %s", job_id, err)
        return
    if result.returncode == 0:
        log.info("requeued Slurm job %s", job_id)
    else:
        log.error("scontrol requeue %s failed (%d): %s", job_id, result.returncode, result.stderr.strip())
