"""Reinforcement learning: actors stepping simulators, learners trained by Lightning, and the plumbing between.

env.py         environments by gymnasium id or factory; EnvSpec
policy.py      the policy interface, running normalisation, MLP policies
rollout.py     stepping a vector of envs into trajectory chunks
shared.py      named tensors in shared memory; atomic pipe messages
weights.py     versioned policy weights in shared memory (lock-free publish and read)
local.py       rollout worker processes: supervision, heartbeats, restarts
inference.py   the central inference server (SEED RL style batching)
ray_backend.py the same actors and server on Ray
replay.py      replay buffer, uniform or prioritized (sum-tree), checkpointable
advantages.py  GAE and V-trace
data.py        RolloutDataModule: actors -> batches of experience for the learner
learner.py     RLLearner, the LightningModule base; ppo.py and sac.py the algorithms
cli.py         `uma rl`
"""

from uma_lightning._lazy import lazy_exports

_EXPORTS = {
    "EnvSpec": "env",
    "PolicyOutput": "policy",
    "GaussianMLPPolicy": "policy",
    "TanhGaussianMLPPolicy": "policy",
    "RunningNorm": "policy",
    "ReplayBuffer": "replay",
    "RolloutDataModule": "data",
    "RLLearner": "learner",
    "PPOLearner": "ppo",
    "SACLearner": "sac",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
