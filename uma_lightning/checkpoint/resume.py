"""Which checkpoint a restarted run continues from, and which MLflow run it continues to log into."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from uma_lightning.checkpoint.directory import committed
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


def continue_tracked_run(loggers, root: Path) -> Optional[str]:
    """Make MLflow loggers log into the run recorded by the newest checkpoint under ``root``, so that a
    resumed job continues one run, and its step axis, instead of opening a new run."""
    from uma_lightning.tracking.mlflow_logger import MLflowLogger  # here: reading checkpoints needs no Lightning

    for _, path in reversed(committed(root)):
        try:
            run_id = read_manifest(path).get("mlflow_run_id")
        except CheckpointError:
            continue
        if run_id:
            for logger in loggers:
                if isinstance(logger, MLflowLogger):
                    logger.continue_run(run_id)
        return run_id
    return None


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
