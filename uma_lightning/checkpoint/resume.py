"""Which checkpoint a restarted run continues from, and which MLflow run it continues to log into."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from uma_lightning.checkpoint.directory import committed
from uma_lightning.checkpoint.identity import LISTED, identity_differences
from uma_lightning.checkpoint.manifest import CheckpointError, read_manifest, verify
from uma_lightning.checkpoint.storage import tensor_metadata

log = logging.getLogger(__name__)


def choose_checkpoint(
    root: Path, process_group: Optional[dist.ProcessGroup] = None, show_progress: bool = False
) -> Optional[Path]:
    """The newest checkpoint under ``root`` that verifies against its manifest and whose index loads; None
    when there is none yet.

    Unusable checkpoints (no manifest, missing or altered files, an index the loader refuses) are
    reported and skipped. With a process group, every rank checksums a share of the files and all
    ranks agree on the answer.
    Raises CheckpointError when checkpoints exist but none is usable: starting over silently would
    throw the run away. ``show_progress`` reports the bytes checksummed (``uma_lightning.progress``).
    """
    candidates = [committed(root)]
    if process_group is not None:
        dist.broadcast_object_list(candidates, src=0, group=process_group)
    candidates = candidates[0]
    rank = dist.get_rank(process_group) if process_group is not None else 0
    world = dist.get_world_size(process_group) if process_group is not None else 1
    for _step, path in reversed(candidates):
        started = time.monotonic()
        problems = [unusable_because(path, rank, world, show_progress)]
        if process_group is not None:
            problems = [None] * world
            dist.all_gather_object(problems, unusable_because(path, rank, world, show_progress), group=process_group)
        found = [problem for share in problems for problem in share]
        if not found:
            if rank == 0:
                log.info("checkpoint %s verified in %.2f s", path, time.monotonic() - started)
            return path
        if rank == 0:
            log.warning("skipping checkpoint %s, it is incomplete or corrupt: %s", path, "; ".join(sorted(set(found))))
    if candidates:
        raise CheckpointError(
            f"{root}: none of the {len(candidates)} checkpoint(s) is usable (see the warnings above); "
            "move them away to start over"
        )
    return None


class RunFinished(Exception):
    """The run whose checkpoints are in the folder already reached its ``max_steps``: there is nothing to do."""


def newest_readable(root: Path) -> Optional[tuple[int, Path, dict]]:
    """``(step, path, manifest)`` of the newest committed checkpoint under ``root`` whose manifest reads
    (its files unchecked); None when there is none."""
    for step, path in reversed(committed(root)):
        try:
            return step, path, read_manifest(path)
        except CheckpointError:
            continue
    return None


def check_resumable(root: Path, identity: dict, max_steps: Optional[int] = None) -> None:
    """Refuse, before anything is written, to resume the checkpoints under ``root`` when they are another
    run's (CheckpointError naming what differs), or when they already reached ``max_steps``
    (RunFinished). Reads the newest checkpoint's manifest only, and the sizes of its files: cheap on
    every rank, before the processes are joined."""
    newest = newest_readable(root)
    if newest is None:
        return
    step, path, manifest = newest
    saved = manifest.get("run")
    differences = identity_differences(saved, identity) if saved else []
    if differences:
        more = f"; and {len(differences) - LISTED} more" if len(differences) > LISTED else ""
        raise CheckpointError(
            f"{root} holds the checkpoints of another run (newest {path.name}), which this one would not resume: "
            f"{'; '.join(differences[:LISTED])}{more}. To start fresh, pass another --trainer.default_root_dir "
            f"or move {root} away; to start from its weights, add --model.init_from {path} as well"
        )
    if max_steps is not None and max_steps >= 0 and step >= max_steps and not verify(path, names=[]):
        raise RunFinished(
            f"{root}: this run already reached max_steps {max_steps} ({path.name}): nothing to train, its "
            f"checkpoints are left as they are. To train it further, raise --trainer.max_steps"
        )


def finish_tracked_run(loggers, root: Path) -> None:
    """Mark the MLflow run of the newest checkpoint under ``root`` FINISHED, for a run that reached its
    ``max_steps`` but was killed before it could say so."""
    from uma_lightning.tracking.mlflow_logger import MLflowLogger

    newest = newest_readable(root)
    run_id = newest[2].get("mlflow_run_id") if newest else None
    if run_id:
        for logger in loggers:
            if isinstance(logger, MLflowLogger):
                logger.finish_run(run_id)


def continue_tracked_run(loggers, root: Path) -> Optional[str]:
    """Make MLflow loggers log into the run recorded by the newest checkpoint under ``root``, so that a
    resumed job continues one run, and its step axis, instead of opening a new run."""
    from uma_lightning.tracking.mlflow_logger import MLflowLogger  # here: reading checkpoints needs no Lightning

    newest = newest_readable(root)
    run_id = newest[2].get("mlflow_run_id") if newest else None
    if run_id:
        for logger in loggers:
            if isinstance(logger, MLflowLogger):
                logger.continue_run(run_id)
    return run_id


def unusable_because(path: Path, rank: int = 0, world: int = 1, show_progress: bool = False) -> list[str]:
    """What makes checkpoint ``path`` unusable, as far as the share of rank ``rank`` of ``world`` shows
    (all of it by default); empty when it can be resumed from."""
    try:
        names = sorted(read_manifest(path)["files"])
    except CheckpointError as err:
        return [str(err)]
    problems = verify(path, names=names[rank::world], show_progress=show_progress)
    if rank == 0 and not problems:
        # Files that match their manifest can still hold an index the loader refuses (one that would
        # unpickle code, re-signed): found here, it is skipped like a failed checksum, not met mid-load.
        try:
            tensor_metadata(path)
        except CheckpointError as err:
            problems.append(str(err))
    return problems
