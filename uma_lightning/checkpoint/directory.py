"""The checkpoints directory of a run: one ``step-NNNNNNNNN`` directory per checkpoint, atomic commits,
retention, and leftovers of interrupted saves.

::

    checkpoints/
      step-000000100/          committed: manifest.json, state.json, .metadata, __<rank>_<n>.distcp
      step-000000200/
      .staging-step-000000300/ being written, or left by a crash; never loaded, removed on the next start
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def staging_path(root: Path, step: int) -> Path:
    return root / f"{STAGING_PREFIX}{step_dirname(step)}"


def committed(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every committed checkpoint directory under ``root``, oldest first (validity unchecked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in root.iterdir()
        if entry.is_dir() and (match := _STEP_DIR.match(entry.name))
    ]
    return sorted(found)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def commit(staging: Path, final: Path) -> None:
    """Rename a fully written staging directory into place, durably.

    A directory of the same name (a checkpoint of the same step from an earlier, diverged attempt) is
    moved aside first and deleted after; until the rename, readers see the older checkpoints only.
    """
    _fsync_directory(staging)
    replaced = None
    if final.exists():
        replaced = final.with_name(f"{STAGING_PREFIX}replaced-{final.name}")
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_directory(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def steps_to_keep(steps: list[int], keep_last: int, keep_every_n_steps: int | None) -> set[int]:
    """The newest ``keep_last`` steps, plus every multiple of ``keep_every_n_steps`` (kept for good)."""
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    if keep_every_n_steps:
        keep |= {step for step in steps if step % keep_every_n_steps == 0}
    return keep


def prune(root: Path, keep_last: int, keep_every_n_steps: int | None) -> list[Path]:
    """Delete committed checkpoints that retention does not keep; returns what was deleted."""
    found = committed(root)
    keep = steps_to_keep([step for step, _ in found], keep_last, keep_every_n_steps)
    removed = [path for step, path in found if step not in keep]
    for path in removed:
        # Rename first, so a crash mid-delete leaves a staging leftover rather than a half-deleted checkpoint.
        doomed = path.with_name(f"{STAGING_PREFIX}deleted-{path.name}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


def remove_staging_leftovers(root: Path) -> list[Path]:
    """Delete staging directories that interrupted saves left behind. Call before this run's first save."""
    leftovers = [entry for entry in root.iterdir() if entry.name.startswith(STAGING_PREFIX)] if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        log.info(
            "removed %d unfinished checkpoint save(s) in %s: %s",
            len(leftovers),
            root,
            ", ".join(p.name for p in leftovers),
        )
    return leftovers
