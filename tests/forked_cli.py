"""Run ``uma`` commands (and multi-rank test workers) as separate processes, forked from a server that
imported everything once.

Starting Python and importing torch, Lightning and MLflow is most of a short run's time. Tests that
start many runs (and kill them) fork each one from a multiprocessing forkserver that has those
imports preloaded. Each run is still a process of its own executing ``uma_lightning.command.main(argv)``,
the function behind the ``uma`` command, with its output in a log file and this process's
environment, as a subprocess would have. Use it wherever a test starts ``uma`` (or its ranks) only
to get fresh processes; start a real interpreter only where the test is about one (the console
script, torchrun, an import-time check).
"""

import multiprocessing
import os
import sys
import time
from pathlib import Path

from suite import free_port

_CONTEXT = multiprocessing.get_context("forkserver")
# MLflow's sqlite store too: every run opens one, and importing it (SQLAlchemy) takes most of a second.
_CONTEXT.set_forkserver_preload(["uma_lightning.cli", "checkpoint_modules", "mlflow.store.tracking.sqlalchemy_store"])


def _main(argv: list[str], log_path: str, cwd: str, env: dict, process_group: int | None) -> None:
    if process_group is not None:
        os.setpgid(0, process_group)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read once, when torch was imported in the server: set it again
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from uma_lightning.command import main

    main(argv)


def start(
    argv: list[str], log_path: Path, cwd: Path, env: dict | None = None, process_group: int | None = None
) -> multiprocessing.Process:
    """Start ``uma <argv>`` in ``cwd`` with ``env`` added to the environment, output appended to ``log_path``,
    in the process group ``process_group`` if given (its children, loader workers, then join it too)."""
    environment = {**os.environ, **(env or {})}
    process = _CONTEXT.Process(
        target=_main, args=(argv, str(log_path), str(cwd), environment, process_group), daemon=False
    )
    process.start()
    return process


def run(argv: list[str], log_path: Path, cwd: Path, timeout: float) -> int:
    """Run ``uma <argv>`` to completion and return its exit status."""
    process = start(argv, log_path, cwd)
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"uma {' '.join(argv)} did not finish within {timeout} s; log: {log_path}")
    return process.exitcode


def rank_log(log_path: Path, rank: int) -> Path:
    return Path(log_path).with_suffix(f".rank{rank}.log")


def start_ranks(argv: list[str], log_path: Path, cwd: Path, world_size: int = 2, env: dict | None = None) -> list:
    """Start ``uma <argv>`` as the ``world_size`` ranks of one job, with the environment torchrun gives
    its processes, so that Lightning joins them into one group instead of launching its own. Rank r's
    output goes to ``rank_log(log_path, r)``."""
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size), "NODE_RANK": "0",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size))}  # fmt: skip
    return [
        start(argv, rank_log(log_path, rank), cwd, {**(env or {}), **job, "LOCAL_RANK": str(rank)})
        for rank in range(world_size)
    ]


def run_as_ranks(
    argv: list[str], log_path: Path, cwd: Path, world_size: int = 2, env: dict | None = None, timeout: float = 300
) -> list:
    """Run ``uma <argv>`` as the ranks of one job (``start_ranks``) to completion; returns their exit
    statuses (-9: killed after ``timeout`` s) and writes their outputs, rank by rank, to ``log_path``."""
    ranks = start_ranks(argv, log_path, cwd, world_size, env)
    deadline = time.monotonic() + timeout
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    Path(log_path).write_text(
        "".join(rank_log(log_path, rank).read_text() for rank in range(world_size) if rank_log(log_path, rank).exists())
    )
    return [process.exitcode for process in ranks]


def run_ranks(function, world_size: int, *args, timeout: float = 300) -> None:
    """Run ``function(rank, world_size, *args)`` in ``world_size`` processes; raise if any fails."""
    processes = [_CONTEXT.Process(target=function, args=(rank, world_size, *args)) for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    failed = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{function.__name__}: ranks failed (rank, exit status): {failed}")
