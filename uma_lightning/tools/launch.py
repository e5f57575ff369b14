"""Run a function on a group of local processes that form one process group, as torchrun would.

Used by ``uma parity`` and the strategy benchmark. The processes fork from a server process that
has imported Lightning once, instead of each importing it again (seconds per process). The
server runs no computation, so forking it is safe (a process that has used OpenMP threads is not).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable

from uma_lightning.ports import free_port


def run_local_group(target: Callable, world_size: int, args: tuple = (), timeout: float = 600) -> None:
    """Call ``target(*args)`` in ``world_size`` processes with torchrun's environment; raise if any fails.

    ``target`` must be importable (a module-level function). A rank that fails leaves the others
    blocked in a collective, so all are stopped at the first failure.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", target.__module__])
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(target, rank, world_size, port, args)) for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
    codes = [p.exitcode for p in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if any(code != 0 for code in codes):
        raise RuntimeError(
            f"group of {world_size} processes failed: exit codes {codes} (None: stopped after another rank failed "
            f"or after {timeout:.0f} s); see the log above"
        )


def _rank_main(target: Callable, rank: int, world_size: int, port: int, args: tuple) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    # Each rank gets its share of the cores; more threads than cores slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    target(*args)
