"""Checkpoints: the whole training state, sharded with torch.distributed.checkpoint, written in the
background, committed atomically with a manifest of checksums, pruned by a retention rule, loadable
under another parallel strategy or world size, and read without unpickling anything untrusted.

The Lightning side (when to save, resuming) is the ``ShardedCheckpoint`` callback; ``uma ckpt``
inspects and exports checkpoints.
"""

from uma_lightning._lazy import lazy_exports

# Imported on first use, so that reading a checkpoint (``weights``, ``Policy``) does not import Lightning.
_EXPORTS = {
    "CheckpointError": "manifest",
    "CheckpointWriter": "writer",
    "check_resumable": "resume",
    "choose_checkpoint": "resume",
    "committed": "directory",
    "continue_tracked_run": "resume",
    "finish_tracked_run": "resume",
    "read_manifest": "manifest",
    "remove_staging_leftovers": "directory",
    "run_identity": "identity",
    "RunFinished": "resume",
    "step_dirname": "directory",
    "steps_to_keep": "directory",
    "verify": "manifest",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
