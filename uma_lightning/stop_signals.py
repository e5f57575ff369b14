"""Stop signals are for the training process alone, not for the helper processes it starts.

Slurm signals every process of a job step (``scancel``, preemption, the time-limit warning), and a
terminal's Ctrl+C reaches its whole foreground process group. The training process answers by
finishing its step, saving and exiting (the ``Preemption`` callback), and it still needs its data
loader workers and RL actors for that. A helper that died on the signal would make the step fail
before the save (PyTorch's worker dies on a SIGTERM from anyone but its parent, and SIGUSR1 ends a
process by default); one that ran the training process's handler, inherited through fork, would
start a second shutdown of its own. So helpers ignore these signals, and the training process stops
them when it is done.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals() -> None:
    """For a helper process that its parent ends with SIGKILL or a message, never with SIGTERM."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class LoaderWorkerSignals:
    """A DataLoader ``worker_init_fn``: the worker ignores stop signals, except a SIGTERM from the
    process that owns the loader. PyTorch ends a worker that does not stop when asked with SIGTERM
    (and multiprocessing ends its daemon children so at exit); ignoring that one would leave a hung
    worker, and the training process waiting for it, alive forever."""

    def __init__(self) -> None:
        self.owner = os.getpid()  # the training process, where the loader is built

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS:
            if signum != signal.SIGTERM:
                signal.signal(signum, signal.SIG_IGN)
        if _thread_count() > 1:
            # Threads started before this function (a forkserver or spawned worker's) would still take
            # SIGTERM with PyTorch's handler, and die: ignore it in the whole process instead.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return
        # A signal handler cannot see who sent the signal; sigwaitinfo can. SIGTERM stays blocked in
        # every thread of the worker (threads started later inherit the mask) and waits for this one.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        senders = {self.owner, os.getppid()}  # the parent is a forkserver when workers do not fork
        threading.Thread(target=_exit_on_sigterm_from, args=(senders,), name="uma-sigterm", daemon=True).start()


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # unknown: assume other threads


def _exit_on_sigterm_from(senders: set[int]) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid in senders:
            os._exit(0)  # as PyTorch's own worker handler does on its parent's SIGTERM
