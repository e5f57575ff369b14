"""Checkpoints: the whole training state, sharded with torch.distributed.checkpoint, written in the
background, committed atomically with a manifest of checksums, pruned by a retention rule, loadable
under another parallel strategy or world size, and read without unpickling anything untrusted.

The Lightning side (when to save, resuming) is the ``ShardedCheckpoint`` callback; ``uma ckpt``
inspects and exports checkpoints.
"""

from uma_lightning.checkpoint.directory import committed, remove_staging_leftovers, step_dirname, steps_to_keep
from uma_lightning.checkpoint.manifest import CheckpointError, read_manifest, verify
from uma_lightning.checkpoint.resume import choose_checkpoint, continue_tracked_run
from uma_lightning.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "choose_checkpoint",
    "committed",
    "continue_tracked_run",
    "read_manifest",
    "remove_staging_leftovers",
    "step_dirname",
    "steps_to_keep",
    "verify",
]
