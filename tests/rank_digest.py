"""A callback that writes what each rank trained, to check that all ranks hold the same model."""

import hashlib
import json
import os
from pathlib import Path

from lightning.pytorch import Callback


class RankDigest(Callback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, pl_module):
        digest = digest_of(pl_module.named_parameters())
        record = {
            "rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "group_rank": os.environ.get("GROUP_RANK"),
            "digest": digest,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def digest_of(named_parameters) -> str:
    """SHA-256 of every (name, whole tensor) in order; a sharded tensor is gathered, a collective every rank calls."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, param in named_parameters:
        full = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(full.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
