"""The data side of RL training: environments, actors, and the batches of experience they produce.

``RolloutDataModule`` owns the actors (local processes or Ray) and hands the learner one batch of
trajectory chunks per Lightning epoch: one RL iteration is collect, then update. It tags what it
hands over with the policy lag (learner version minus the version that acted), drops chunks staler
than ``max_policy_lag``, and reports episode returns, throughput, time the learner waited and the
lag distribution alongside every batch.

With ``max_policy_lag: 0`` collection is synchronous: each worker waits for the newest policy before
every chunk and a batch holds one chunk from each worker, so a run is reproducible from its seed.
With a larger lag, workers never wait and the learner corrects lagged data with V-trace.
"""

# No `from __future__ import annotations`: LightningCLI reads the real annotations of __init__.
import logging
import math
import os
import time
from collections import deque
from typing import Any, Literal, Optional

import lightning as L
import torch

from uma_lightning.rl.env import EnvSpec, probe_env

log = logging.getLogger("uma_lightning")


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        env: str = "Humanoid-v5",
        env_kwargs: Optional[dict[str, Any]] = None,
        total_env_steps: int = 1_000_000,
        n_workers: int = 2,
        envs_per_worker: int = 8,
        steps_per_chunk: int = 64,
        chunks_per_batch: Optional[int] = None,
        max_policy_lag: int = 0,
        inference: Literal["local", "server"] = "local",
        server_max_batch: Optional[int] = None,
        server_max_wait_ms: float = 2.0,
        server_device: str = "auto",
        backend: Literal["local", "ray"] = "local",
        ray_address: Optional[str] = None,
        slots_per_worker: Optional[int] = None,
        heartbeat_timeout: float = 60.0,
        startup_timeout: float = 300.0,
        return_window: int = 20,
        seed: Optional[int] = None,
    ) -> None:
        """
        Args:
            env: A gymnasium id (``Humanoid-v5``) or a factory ``package.module:function`` returning an env.
            env_kwargs: Keyword arguments for ``gymnasium.make`` or the factory.
            total_env_steps: Environment steps to collect over the whole run (all ranks together).
            n_workers: Rollout worker processes (per learner rank).
            envs_per_worker: Environments each worker steps as one vector.
            steps_per_chunk: Steps per environment in one trajectory chunk.
            chunks_per_batch: Chunks per learner iteration; None means one per worker.
            max_policy_lag: Policy versions a chunk may lag behind the learner; staler chunks are
                dropped. 0 makes collection synchronous (workers wait for every new version).
            inference: ``local``: each worker runs its own copy of the policy (small policies).
                ``server``: one process batches every worker's observations (large policies, accelerator).
            server_max_batch: The server acts once it has this many observations; None means all envs.
            server_max_wait_ms: ... or once this long has passed since the first request.
            server_device: Device of the inference server; ``auto`` uses CUDA when available.
            backend: ``local`` processes on this machine, or ``ray`` actors (needs the ``ray`` extra).
            ray_address: Ray cluster to join; None starts or joins a local one.
            slots_per_worker: Chunks a worker may have finished before the learner takes them; None means
                ``max(1, max_policy_lag)``, as deep as the lag allows (the learner takes one chunk per
                worker per iteration, so a deeper queue would only fill with chunks it drops).
            heartbeat_timeout: Seconds without a heartbeat after which an actor is restarted.
            startup_timeout: Seconds an actor may take to start.
            return_window: Episodes averaged in ``rollout/return_window``.
            seed: Seed of environments and action sampling; None uses the run's ``seed_everything``.
        """
        super().__init__()
        for name, value in (
            ("total_env_steps", total_env_steps),
            ("n_workers", n_workers),
            ("envs_per_worker", envs_per_worker),
            ("steps_per_chunk", steps_per_chunk),
            ("return_window", return_window),
        ):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        if max_policy_lag < 0:
            raise ValueError(f"data.max_policy_lag must be >= 0, got {max_policy_lag}")
        for name, value in (("chunks_per_batch", chunks_per_batch), ("slots_per_worker", slots_per_worker)):
            if value is not None and value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        self.save_hyperparameters()
        try:
            self.env_spec: EnvSpec = probe_env(env, env_kwargs)
        except (ValueError, TypeError, ImportError) as err:
            raise ValueError(f"data.env: {err}") from None
        self.chunks_per_batch = chunks_per_batch or n_workers
        self.actors = None
        self.version = -1
        # Counters that survive a resume (see state_dict).
        self.env_steps = 0  # this rank's, received from actors (dropped chunks included)
        self.dropped_chunks = 0
        self.restarts_before = 0  # actor restarts in earlier runs of this training
        self.recent_returns: deque[float] = deque(maxlen=return_window)
        self._last_batch_time: Optional[float] = None

    # ---- called by the learner ----------------------------------------------------------------------

    def start(self, policy: torch.nn.Module, return_discount: float) -> None:
        """Start the actors with a copy of ``policy``; they act once the first version is published."""
        from uma_lightning.rl.local import ActorSetup

        if self.actors is not None:
            return
        hp = self.hparams
        rank = self.trainer.global_rank if self.trainer is not None else 0
        seed = hp.seed if hp.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        setup = ActorSetup(
            spec=self.env_spec,
            env_kwargs=dict(hp.env_kwargs or {}),
            n_envs=hp.envs_per_worker,
            steps=hp.steps_per_chunk,
            # Ranks get different seeds; a resumed run continues with fresh episodes, not its first ones again.
            seed=seed + 100_003 * rank + self.env_steps,
            synchronous=hp.max_policy_lag == 0,
            return_discount=return_discount,
        )
        server = None
        if hp.inference == "server":
            device = (
                hp.server_device if hp.server_device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            )
            server = {
                "max_batch": hp.server_max_batch or hp.n_workers * hp.envs_per_worker,
                "max_wait": hp.server_max_wait_ms / 1000,
                "device": device,
            }
        n_params = sum(p.numel() for p in policy.parameters())
        mode = "synchronous" if setup.synchronous else f"asynchronous, max policy lag {hp.max_policy_lag}"
        where = (
            "per-worker inference"
            if server is None
            else (
                f"inference server on {server['device']} (batches of up to {server['max_batch']} observations or {hp.server_max_wait_ms} ms)"
            )
        )
        log.info(
            "actors: %d %s worker(s) x %d %s envs, %d steps per chunk, %s, %s; policy of %d parameters",
            hp.n_workers,
            hp.backend,
            hp.envs_per_worker,
            self.env_spec.env,
            hp.steps_per_chunk,
            mode,
            where,
            n_params,
        )
        if hp.backend == "ray":
            from uma_lightning.rl.ray_backend import RayActors

            self.actors = RayActors(
                setup,
                policy,
                hp.n_workers,
                server=server,
                heartbeat_timeout=hp.heartbeat_timeout,
                startup_timeout=hp.startup_timeout,
                address=hp.ray_address,
            )
        else:
            from uma_lightning.rl.local import LocalActors

            slots = hp.slots_per_worker or max(1, hp.max_policy_lag)
            self.actors = LocalActors(
                setup,
                policy,
                hp.n_workers,
                slots_per_worker=slots,
                server=server,
                heartbeat_timeout=hp.heartbeat_timeout,
                startup_timeout=hp.startup_timeout,
            )

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """Make ``policy``'s current weights the newest version; actors switch at their next chunk."""
        self.actors.publish(policy.state_dict(), version)
        self.version = version

    @property
    def budget(self) -> int:
        """Environment steps this rank collects."""
        world = self.trainer.world_size if self.trainer is not None else 1
        return math.ceil(self.hparams.total_env_steps / world)

    @property
    def done(self) -> bool:
        return self.env_steps >= self.budget

    @property
    def progress(self) -> float:
        return min(self.env_steps / self.budget, 1.0)

    @property
    def local_workers(self) -> int:
        """Actor processes on this machine (an inference server counts as one more)."""
        if self.hparams.backend != "local":
            return 0
        return self.hparams.n_workers + (self.hparams.inference == "server")

    @property
    def restarts(self) -> int:
        return self.restarts_before + (self.actors.restarts if self.actors is not None else 0)

    # ---- Lightning hooks ------------------------------------------------------------------------------

    def train_dataloader(self):
        return _OneBatchPerEpoch(self)

    def teardown(self, stage: str) -> None:
        if self.actors is not None:
            self.restarts_before = self.restarts
            self.actors.close()
            self.actors = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "env_steps": self.env_steps,
            "dropped_chunks": self.dropped_chunks,
            "restarts": self.restarts,
            "recent_returns": list(self.recent_returns),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env_steps, self.dropped_chunks = state["env_steps"], state["dropped_chunks"]
        self.restarts_before = state["restarts"]
        self.recent_returns.extend(state["recent_returns"])

    # ---- collection ------------------------------------------------------------------------------------

    def next_batch(self) -> dict[str, Any]:
        """Chunks for one learner iteration, joined along the env axis (``[T, chunks * envs, ...]``),
        and the statistics to log with it."""
        if self.actors is None:
            raise RuntimeError("RolloutDataModule.start(policy) must be called before collecting (the learner does it)")
        hp = self.hparams
        start = time.monotonic()
        chunks, lags = [], []
        episodes_return, episodes_length = [], []
        dropped = 0
        steps_before = self.env_steps
        while len(chunks) < self.chunks_per_batch:
            chunk = self.actors.next_chunk()
            self.env_steps += chunk.data["reward"].numel()
            ends = chunk.data["terminated"] | chunk.data["truncated"]
            episodes_return += chunk.data["episode_return"][ends].tolist()
            episodes_length += chunk.data["episode_length"][ends].tolist()
            lag = self.version - int(chunk.data["version"].min())
            if lag > hp.max_policy_lag:
                dropped += 1
                continue
            chunks.append(chunk)
            lags.append(lag)
        now = time.monotonic()
        waited = now - start
        since_last = now - self._last_batch_time if self._last_batch_time is not None else waited
        self._last_batch_time = now
        self.dropped_chunks += dropped
        self.recent_returns.extend(episodes_return)
        chunks.sort(key=lambda c: (c.worker, c.incarnation, c.sequence))
        batch = {name: torch.cat([c.data[name] for c in chunks], dim=1) for name in chunks[0].data}
        world = self.trainer.world_size if self.trainer is not None else 1
        stats = {
            "rollout/env_steps": float(self.env_steps * world),
            "throughput/env_steps_per_sec": (self.env_steps - steps_before) * world / max(since_last, 1e-9),
            "time/wait_for_data_sec": waited,
            "time/wait_fraction": waited / max(since_last, 1e-9),
            "actors/restarts": float(self.restarts),
            "policy_lag/mean": sum(lags) / len(lags),
            "policy_lag/max": float(max(lags)),
            "policy_lag/dropped_chunks": float(dropped),
        }
        # The lag histogram: fraction of this batch's chunks at each lag, dropped ones included.
        for lag in range(hp.max_policy_lag + 1):
            stats[f"policy_lag/lag_{lag}"] = lags.count(lag) / (len(lags) + dropped)
        if episodes_return:
            stats["rollout/episode_return"] = sum(episodes_return) / len(episodes_return)
            stats["rollout/episode_length"] = sum(episodes_length) / len(episodes_length)
        if self.recent_returns:
            stats["rollout/return_window"] = sum(self.recent_returns) / len(self.recent_returns)
        return {"trajectories": batch, "stats": stats}


class _OneBatchPerEpoch:
    """The learner's dataloader: each Lightning epoch is one RL iteration, so it yields one batch.

    Lightning fetches the next batch before running the current one; with one batch per epoch that
    fetch finds the end, so collection never starts before the previous update was published."""

    def __init__(self, data: RolloutDataModule):
        self.data = data

    def __iter__(self):
        if not self.data.done:
            yield self.data.next_batch()
