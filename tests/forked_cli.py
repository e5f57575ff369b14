"""Run ``uma`` commands (and multi-rank test workers) as separate processes, forked from a server that
imported everything once.

Starting Python and importing torch, Lightning and MLflow is most of a short run's time. Tests that
start many runs (and kill them) fork each one from a multiprocessing forkserver that has those
imports preloaded. Each run is still a process of its own executing ``uma_lightning.cli.main(argv)``,
the function behind the ``uma`` command, with its output in a log file.
"""

import multiprocessing
import os
import sys
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["uma_lightning.cli", "checkpoint_modules"])


def _main(argv: list[str], log_path: str, cwd: str, env: dict, process_group: int | None) -> None:
    if process_group is not None:
        os.setpgid(0, process_group)
    os.chdir(cwd)
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from uma_lightning.cli import main

    main(argv)


def start(argv: list[str], log_path: Path, cwd: Path, env: dict | None = None, process_group: int | None = None) -> multiprocessing.Process:
    """Start ``uma <argv>`` in ``cwd`` with ``env`` added to the environment, output appended to ``log_path``,
    in the process group ``process_group`` if given (its children, loader workers, then join it too)."""
    process = _CONTEXT.Process(target=_main, args=(argv, str(log_path), str(cwd), env or {}, process_group), daemon=False)
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
