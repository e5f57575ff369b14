"""Stepping a vector of environments with a policy into fixed-size trajectory chunks.

A chunk holds ``steps`` consecutive steps of ``n_envs`` environments, time first:

    obs                float32 [T, N, obs_dim]    raw observation the action was chosen from
    next_obs           float32 [T, N, obs_dim]    observation after the step; at an episode end the
                                                   final observation, not the next episode's first
    action             float32 [T, N, action_dim] sampled action (the env receives it clipped to bounds)
    log_prob           float32 [T, N]             log-probability of the action under the acting policy
    value              float32 [T, N]             acting policy's value estimate (0 without a value head)
    reward             float32 [T, N]
    terminated         bool    [T, N]             the episode ended in a terminal state: no bootstrapping
    truncated          bool    [T, N]             the episode was cut (time limit): bootstrap from next_obs
    version            int64   [T, N]             policy version that chose the action
    discounted_return  float32 [T, N]             running discounted return, for reward scaling
    episode_return     float32 [T, N]             return of the episode ending at this step (where it ends)
    episode_length     int64   [T, N]             length of the episode ending at this step (where it ends)

The same runner fills shared-memory slots in local actor processes and plain arrays on Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from uma_lightning.rl.env import EnvSpec, EnvVector
from uma_lightning.rl.policy import PolicyOutput, fused_act

# act(obs [N, obs_dim], action [N, A], log_prob [N], value [N]) -> version: acts on float32 observations,
# writing into the three float32 arrays given (the chunk's rows); returns the policy version that acted.
ActFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]


def chunk_layout(spec: EnvSpec, steps: int, n_envs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    tn = (steps, n_envs)
    return {
        "obs": ((*tn, spec.obs_dim), torch.float32),
        "next_obs": ((*tn, spec.obs_dim), torch.float32),
        "action": ((*tn, spec.action_dim), torch.float32),
        "log_prob": (tn, torch.float32),
        "value": (tn, torch.float32),
        "reward": (tn, torch.float32),
        "terminated": (tn, torch.bool),
        "truncated": (tn, torch.bool),
        "version": (tn, torch.int64),
        "discounted_return": (tn, torch.float32),
        "episode_return": (tn, torch.float32),
        "episode_length": (tn, torch.int64),
    }


class EnvRunner:
    """A vector of environments and the bookkeeping that spans chunks (running returns and lengths)."""

    def __init__(
        self, spec: EnvSpec, env_kwargs: Optional[dict[str, Any]], n_envs: int, seed: int, return_discount: float
    ):
        self.envs = EnvVector(spec.env, env_kwargs, n_envs)
        self.obs = np.empty((n_envs, spec.obs_dim), np.float32)
        self.envs.reset([seed + i for i in range(n_envs)], self.obs)
        self.low, self.high = np.array(spec.action_low, np.float32), np.array(spec.action_high, np.float32)
        self.return_discount = return_discount
        self.episode_return = np.zeros(n_envs, np.float64)
        self.episode_length = np.zeros(n_envs, np.int64)
        self.discounted = np.zeros(n_envs, np.float64)

    @torch.inference_mode()
    def fill(self, chunk: dict[str, np.ndarray], act: ActFn, heartbeat: Callable[[], None] = lambda: None) -> None:
        """Step ``T`` times, writing every step into ``chunk`` (arrays laid out as ``chunk_layout``).

        The envs write observations, terminations and truncations straight into the chunk, converted on
        the way, and the policy acts on the chunk's own row and writes its actions, log-probabilities
        and values into the chunk's rows: no step makes a private copy first. The whole chunk runs in
        inference mode: entered per step, between simulator steps, it cost up to 50 us per batch, as
        much as a layer of the policy. For the same reason the running returns and lengths are
        added up after the last step, when the same numpy ops cost a fraction of what they cost
        between simulator steps, with the caches cold."""
        obs_rows, next_rows, steps = chunk["obs"], chunk["next_obs"], chunk["reward"].shape[0]
        actions, log_probs, values, versions = chunk["action"], chunk["log_prob"], chunk["value"], chunk["version"]
        terminated, truncated = chunk["terminated"], chunk["truncated"]
        rewards = np.empty(chunk["reward"].shape, np.float64)  # the running sums add rewards before rounding to float32
        clipped = np.empty_like(actions[0])
        obs_rows[0] = self.obs
        for t in range(steps):
            versions[t] = act(obs_rows[t], actions[t], log_probs[t], values[t])
            # The next step acts on the next episode's first observation; next_obs keeps the last one.
            next_obs = obs_rows[t + 1] if t + 1 < steps else self.obs
            np.clip(actions[t], self.low, self.high, out=clipped)
            self.envs.step(clipped, next_obs, next_rows[t], rewards[t], terminated[t], truncated[t])
            heartbeat()
        self._add_up_returns(chunk, rewards)

    def _add_up_returns(self, chunk: dict[str, np.ndarray], rewards: np.ndarray) -> None:
        """The chunk's rewards, running discounted returns, and episode returns and lengths, step by step
        from where the last chunk left them."""
        chunk["reward"][:] = rewards
        done = chunk["terminated"] | chunk["truncated"]
        for t, reward in enumerate(rewards):
            self.discounted *= self.return_discount
            self.discounted += reward
            chunk["discounted_return"][t] = self.discounted
            self.episode_return += reward
            self.episode_length += 1
            chunk["episode_return"][t] = self.episode_return
            chunk["episode_length"][t] = self.episode_length
            if done[t].any():
                self.episode_return[done[t]] = 0.0
                self.episode_length[done[t]] = 0
                self.discounted[done[t]] = 0.0

    def close(self) -> None:
        self.envs.close()


class PolicyActor:
    """Acts with a local copy of the policy: one batched forward pass for all of a worker's envs,
    through the policy's ``numpy_act`` where it has one. Copy new weights into ``state`` and set
    ``version`` with them: that binding is redone when the version or the batch size changes."""

    def __init__(self, policy: torch.nn.Module, version: int = -1):
        # Without gradients it acts outside inference mode too; EnvRunner.fill enters that once per chunk.
        self.policy = policy.eval().requires_grad_(False)
        self.state = policy.state_dict()  # views of the parameters: copying into them updates the policy
        self.version = version
        self.numpy_act = fused_act(self.policy, "numpy_act")
        self.bound: Optional[tuple[int, int, Callable]] = None  # (version, batch size, numpy_act's binding)

    def __call__(self, obs: np.ndarray, action: np.ndarray, log_prob: np.ndarray, value: np.ndarray) -> int:
        if self.numpy_act is None:
            for out, result in zip((action, log_prob, value), sample_actions(self.policy, torch.from_numpy(obs))):
                out[...] = result.numpy()
            return self.version
        if self.bound is None or self.bound[:2] != (self.version, len(obs)):
            self.bound = (self.version, len(obs), self.numpy_act(len(obs)))
        self.bound[2](obs, action, log_prob, value)
        return self.version


def sample_actions(policy: torch.nn.Module, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(action, log_prob, value) for a batch: through the policy's fused ``act`` where it has one."""
    act = fused_act(policy)
    return act(obs) if act is not None else sample_from_distribution(policy, obs)


def sample_from_distribution(
    policy: torch.nn.Module, obs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference computation: ``forward``'s distribution, sampled, and the sample's log-probability."""
    out: PolicyOutput = policy(obs)
    action = out.distribution.sample()
    value = out.value if out.value is not None else torch.zeros(obs.shape[0], device=obs.device)
    return action, out.distribution.log_prob(action), value
