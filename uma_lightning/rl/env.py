"""Environments: a gymnasium id or a factory, the shapes a policy is built for, and vectorised stepping.

``env`` in a config is either a registered gymnasium id (``Humanoid-v5``) or the import path of a
factory, ``package.module:function``, called with ``env_kwargs`` and returning a ``gymnasium.Env``.
Observations and actions must be flat ``Box`` spaces (continuous control).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class EnvSpec:
    """What a policy needs to know about an environment."""

    env: str
    obs_dim: int
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    max_episode_steps: Optional[int] = None

    def __post_init__(self) -> None:
        # YAML and JSON give lists; keep the spec hashable and comparable.
        object.__setattr__(self, "action_low", tuple(float(x) for x in self.action_low))
        object.__setattr__(self, "action_high", tuple(float(x) for x in self.action_high))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_env(env: str, env_kwargs: Optional[dict[str, Any]] = None):
    """One environment from a gymnasium id or a ``module:function`` factory."""
    import gymnasium

    kwargs = dict(env_kwargs or {})
    factory = _factory(env)
    if factory is not None:
        return factory(**kwargs)
    try:
        return gymnasium.make(env, **kwargs)
    except gymnasium.error.Error as err:
        raise ValueError(f"env {env!r}: {err}") from None


def _factory(env: str):
    """The callable named by ``module:function``, or None when ``env`` is a gymnasium id."""
    module_name, sep, name = env.partition(":")
    if not sep or not name.isidentifier():
        return None  # gymnasium's own "module:Env-v0" form has a '-' and is left to gymnasium.make
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env factory {env!r}: cannot import {module_name!r} ({err})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"env factory {env!r}: {module_name} has no callable {name!r}")
    return factory


def probe_env(env: str, env_kwargs: Optional[dict[str, Any]] = None) -> EnvSpec:
    """Build one environment to read its spaces; raises ValueError naming the env for unsupported ones."""
    from gymnasium import spaces

    instance = make_env(env, env_kwargs)
    try:
        obs_space, action_space = instance.observation_space, instance.action_space
        if not isinstance(obs_space, spaces.Box) or len(obs_space.shape) != 1:
            raise ValueError(f"env {env!r}: observations must be a flat Box, got {obs_space}")
        if not isinstance(action_space, spaces.Box) or len(action_space.shape) != 1:
            raise ValueError(f"env {env!r}: only continuous actions (a flat Box) are supported, got {action_space}")
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"env {env!r}: action bounds must be finite, got {action_space}")
        spec = getattr(instance, "spec", None)
        return EnvSpec(
            env=env,
            obs_dim=int(obs_space.shape[0]),
            action_dim=int(action_space.shape[0]),
            action_low=tuple(action_space.low.tolist()),
            action_high=tuple(action_space.high.tolist()),
            max_episode_steps=getattr(spec, "max_episode_steps", None),
        )
    finally:
        instance.close()


def make_vector_env(env: str, env_kwargs: Optional[dict[str, Any]], n_envs: int):
    """gymnasium's own vector of ``n_envs`` copies stepped in this process: the reference ``EnvVector``
    is tested against, and what raw stepping in the benchmarks runs. An episode's end and the next
    one's first observation come back from the same ``step`` call; the last observation is in
    ``info["final_obs"]``."""
    import gymnasium

    return gymnasium.vector.SyncVectorEnv(
        [partial(make_env, env, env_kwargs) for _ in range(n_envs)],
        autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP,
    )


class EnvVector:
    """``n_envs`` copies stepped one after another in this process, with the semantics of
    ``make_vector_env`` (same-step autoreset, unseeded resets after the first), writing each result
    straight into the caller's arrays. Actors use it because gymnasium's vector spends about half as much
    CPU per step as a 64x64 policy does, merging info dicts and copying batches nobody reads."""

    def __init__(self, env: str, env_kwargs: Optional[dict[str, Any]], n_envs: int):
        self.envs = [make_env(env, env_kwargs) for _ in range(n_envs)]

    def reset(self, seeds: list[int], obs_out: np.ndarray) -> None:
        for i, (instance, seed) in enumerate(zip(self.envs, seeds, strict=True)):
            obs_out[i] = instance.reset(seed=seed)[0]

    def step(
        self,
        actions: np.ndarray,
        obs_out: np.ndarray,
        final_obs_out: np.ndarray,
        reward_out: np.ndarray,
        terminated_out: np.ndarray,
        truncated_out: np.ndarray,
    ) -> None:
        """Step env ``i`` with ``actions[i]``. ``final_obs_out[i]`` gets the observation the step returned;
        ``obs_out[i]`` the one to act on next, the next episode's first where this one ended."""
        for i, instance in enumerate(self.envs):
            obs, reward_out[i], terminated, truncated, _ = instance.step(actions[i])
            terminated_out[i], truncated_out[i] = terminated, truncated
            final_obs_out[i] = obs
            if terminated or truncated:
                obs = instance.reset()[0]
            obs_out[i] = obs

    def close(self) -> None:
        for instance in self.envs:
            instance.close()
