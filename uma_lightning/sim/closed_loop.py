"""Closed-loop evaluation: a policy drives planar-arm episodes and succeeds or not, as the expert did.

The policy is any callable from a batch of observations to action chunks (``uma_lightning.Policy``
is one). Episodes run in lockstep in a batch: every ``execute_steps`` environment steps the policy
sees the last ``n_obs_steps`` observations of every episode and returns a chunk per episode, whose
first ``execute_steps`` actions are executed. With ``stop_when_done=False`` the number of policy
calls is fixed by the step limit, so processes that split the episodes between them (and shard
the model) call it equally often.

Scenes come from seeds the dataset generator never uses, so a trained policy is tested on new scenes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from uma_lightning.sim.planar_arm import PlanarArmConfig, PlanarArmEnv

# Part of every evaluation seed's entropy; dataset episodes are seeded from (seed, attempt) pairs.
EVALUATION_STREAM = 0x5EED0E7A


@dataclass(frozen=True)
class EpisodeResult:
    seed: int
    success: bool
    steps: int
    goal_distance: float  # end effector to the named target at the end of the episode


def evaluation_seed(index: int, seed: int = 0) -> int:
    return int(np.random.SeedSequence([EVALUATION_STREAM, seed, index]).generate_state(1)[0])


def run_episodes(
    act: Callable[[dict], np.ndarray],
    episode_indices: list[int],
    n_obs_steps: int,
    execute_steps: int,
    seed: int = 0,
    config: PlanarArmConfig | None = None,
    stop_when_done: bool = True,
) -> list[EpisodeResult]:
    """Run the episodes ``episode_indices`` (scenes ``evaluation_seed(i, seed)``) together in lockstep.

    ``act`` gets ``{"images": uint8 [B, T, 1, H, W, 3], "state": float32 [B, T, state_dim],
    "instruction": list of B str}`` and returns actions ``[B, horizon, action_dim]``.
    """
    if execute_steps < 1:
        raise ValueError(f"execute_steps must be >= 1, got {execute_steps}")
    envs = [PlanarArmEnv(config) for _ in episode_indices]
    seeds = [evaluation_seed(i, seed) for i in episode_indices]
    observations = [env.reset(seed=s)[0] for env, s in zip(envs, seeds)]
    # Before the first frame, history repeats it, as in the training data.
    history = [[obs] * n_obs_steps for obs in observations]
    done = [False] * len(envs)
    success = [False] * len(envs)
    max_steps = envs[0].config.max_steps if envs else 0
    for _ in range(math.ceil(max_steps / execute_steps)):
        batch = {
            "images": np.stack([np.stack([o["image"] for o in h])[:, None] for h in history]),
            "state": np.stack([np.stack([o["state"] for o in h]) for h in history]).astype(np.float32),
            "instruction": [h[-1]["instruction"] for h in history],
        }
        chunks = np.asarray(act(batch), dtype=np.float64)
        if chunks.ndim != 3 or chunks.shape[0] != len(envs) or chunks.shape[1] < execute_steps:
            raise ValueError(
                f"the policy returned actions of shape {chunks.shape}; need [{len(envs)}, >= {execute_steps}, action_dim]"
            )
        for index, env in enumerate(envs):
            for action in chunks[index, :execute_steps]:
                if done[index]:
                    break
                obs, _, terminated, truncated, info = env.step(action)
                history[index] = history[index][1:] + [obs]
                done[index] = terminated or truncated
                success[index] = info["success"]
        if stop_when_done and all(done):
            break
    return [EpisodeResult(s, ok, env.steps, env.goal_distance()) for s, ok, env in zip(seeds, success, envs)]


def random_policy(horizon: int, action_dim: int, seed: int = 0) -> Callable[[dict], np.ndarray]:
    """Uniform random actions in [-1, 1]: the baseline a trained policy must beat."""
    rng = np.random.default_rng(seed)
    return lambda batch: rng.uniform(-1.0, 1.0, size=(len(batch["instruction"]), horizon, action_dim))
