"""What the RL tests check: that rollouts were computed by the policy version they name, and (a callback
added from the command line) what a learner process ended with."""

import hashlib
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback


def new_weights(policy: torch.nn.Module, seed: int) -> None:
    """Distinct weights and observation statistics for every version."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in policy.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=g, dtype=tensor.dtype) + 0.5)


def check_versions(chunks, snapshots: dict, newest_seen: dict) -> None:
    """Every step was computed by exactly the weights its version tag names, and by no other version;
    a worker's tags never go back in time."""
    for chunk in chunks:
        tags = chunk.data["version"]
        assert int(tags.min()) >= newest_seen.get(chunk.worker, -1)
        newest_seen[chunk.worker] = int(tags.max())
        for tag in tags.unique().tolist():
            steps = tags == tag
            obs, action = chunk.data["obs"][steps], chunk.data["action"][steps]
            with torch.no_grad():
                out = snapshots[tag](obs)
                assert torch.allclose(out.value, chunk.data["value"][steps], atol=1e-5)
                assert torch.allclose(out.distribution.log_prob(action), chunk.data["log_prob"][steps], atol=1e-4)
                for other, snapshot in snapshots.items():
                    if other != tag:
                        assert not torch.allclose(snapshot(obs).value, chunk.data["value"][steps], atol=1e-3)


def collect_until_version(actors, version: int) -> list:
    """Every chunk received up to the first one computed wholly by ``version``."""
    chunks = []
    while not any(int(c.data["version"].min()) == version for c in chunks):
        chunks.append(actors.next_chunk(timeout=120))
    return chunks


class PolicyDigest(Callback):
    """Writes ``<out_dir>/rank<r>.json`` at the end of fit: a hash of the policy's weights and statistics,
    and this rank's counters."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_fit_end(self, trainer, pl_module) -> None:
        state = pl_module.policy.state_dict()
        digest = hashlib.sha256(
            b"".join(state[name].detach().cpu().numpy().tobytes() for name in sorted(state))
        ).hexdigest()
        facts = {
            "digest": digest,
            "env_steps": trainer.datamodule.env_steps,
            "global_step": trainer.global_step,
            "policy_version": pl_module.policy_version,
            "world_size": trainer.world_size,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(facts))
