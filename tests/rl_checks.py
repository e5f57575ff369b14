"""A callback the RL tests add from the command line to see inside a learner process."""

import hashlib
import json
from pathlib import Path

from lightning.pytorch import Callback


class PolicyDigest(Callback):
    """Writes ``<out_dir>/rank<r>.json`` at the end of fit: a hash of the policy's weights and statistics,
    and this rank's counters."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_fit_end(self, trainer, pl_module) -> None:
        state = pl_module.policy.state_dict()
        digest = hashlib.sha256(b"".join(state[name].detach().cpu().numpy().tobytes() for name in sorted(state))).hexdigest()
        facts = {"digest": digest, "env_steps": trainer.datamodule.env_steps, "global_step": trainer.global_step,
                 "policy_version": pl_module.policy_version, "world_size": trainer.world_size}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(facts))
