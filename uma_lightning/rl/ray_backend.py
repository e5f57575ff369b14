"""Rollout workers and the inference server as Ray actors, for actors on more than one machine.

The interface is ``LocalActors``': ``publish(state, version)``, ``next_chunk()``, ``restarts`` and
``close()``. Each worker is a Ray actor holding its environments between calls; the learner keeps
one ``rollout`` call in flight per worker and takes whichever chunk finishes first. Weights are put
into the object store once per version and every call carries a reference to them, which a worker
resolves only when the version is newer than its own. Ray restarts a worker whose process died
(``max_restarts``); a call that does not finish within ``heartbeat_timeout`` (``startup_timeout``
for a worker's first call) marks the worker hung, and it is killed for Ray to restart. Either way
the unfinished chunk is discarded, and the learner counts a restart when the worker answers from
a new process.

Actors are named by role and index (`rollout-worker-0`, ..., `inference-server`; a restarted actor
keeps its name) in a namespace of their own per run (`uma-rl-<8 hex>`), so that two runs on one
cluster do not collide: `ray list actors --filter ray_namespace=<it>` shows one run's actors.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
import warnings
from typing import Any, Optional

import numpy as np
import torch

from uma_lightning.rl.local import ActorSetup, Chunk
from uma_lightning.rl.rollout import EnvRunner, PolicyActor, chunk_layout, sample_actions

log = logging.getLogger("uma_lightning")

INFERENCE_SERVER_NAME = "inference-server"


def rollout_worker_name(index: int) -> str:
    return f"rollout-worker-{index}"


class RayActors:
    def __init__(
        self,
        setup: ActorSetup,
        policy: torch.nn.Module,
        n_workers: int,
        server: Optional[dict[str, Any]] = None,
        heartbeat_timeout: float = 60.0,
        startup_timeout: float = 300.0,
        address: Optional[str] = None,
    ):
        try:
            import ray
        except ImportError:
            raise ImportError('data.backend=ray needs Ray: pip install -e ".[ray]"') from None
        self.ray = ray
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # The dashboard where the `ray` extra installed it (ray[default]): `ray list actors` and
            # the state API ask it, also about a cluster this run starts for itself.
            ray.init(address=address, include_dashboard=None, log_to_driver=True)
        self.setup, self.heartbeat_timeout, self.startup_timeout = setup, heartbeat_timeout, startup_timeout
        self.namespace = f"uma-rl-{uuid.uuid4().hex[:8]}"
        policy = copy.deepcopy(policy).cpu()
        self.server = None
        if server is not None:
            server_cls = ray.remote(
                num_cpus=0, num_gpus=1 if server["device"].startswith("cuda") else 0, max_restarts=-1
            )(RayInferenceServer)
            self.server = server_cls.options(name=INFERENCE_SERVER_NAME, namespace=self.namespace).remote(
                policy, server["max_batch"], server["max_wait"], server["device"]
            )
        worker_cls = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0)(RayRolloutWorker)
        self.workers = [
            worker_cls.options(name=rollout_worker_name(index), namespace=self.namespace).remote(
                index, setup, None if self.server else policy, self.server
            )
            for index in range(n_workers)
        ]
        log.info(
            "ray: %d actor(s) %s..%s%s in namespace %s",
            n_workers,
            rollout_worker_name(0),
            rollout_worker_name(n_workers - 1),
            f" and {INFERENCE_SERVER_NAME}" if self.server is not None else "",
            self.namespace,
        )
        self.pending: dict[Any, tuple[int, float]] = {}  # in-flight rollout call -> (worker, submitted at)
        self.last_version = [-1] * n_workers  # per worker: newest version in its last chunk
        self.incarnations = [0] * n_workers  # restarts are counted when a worker answers from a new process
        self.pids: list[Optional[int]] = [None] * n_workers
        self.started = [False] * n_workers  # a worker's first call also pays for its start-up
        self.sequences = [0] * n_workers
        self.weights_ref = None
        self.version = -1
        self.restarts = 0

    def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        # Once per version into the object store; workers and server fetch it from there.
        self.weights_ref = self.ray.put({name: t.detach().cpu().numpy() for name, t in state.items()})
        self.version = version
        if self.server is not None:
            self.server.set_weights.remote([self.weights_ref], version)

    def next_chunk(self, timeout: Optional[float] = None) -> Chunk:
        ray = self.ray
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._kill_hung()
            self._submit_idle()
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.5)
            if ready:
                index, _ = self.pending.pop(ready[0])
                try:
                    data, pid = ray.get(ready[0])
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                    # The call is lost with the process; Ray restarts the actor and the call is made again.
                    log.warning(
                        "ray actor %d lost its call (%s); its unfinished chunk is discarded", index, type(err).__name__
                    )
                    self.started[index] = False
                    self.last_version[index] = -1
                    continue
                if self.pids[index] is not None and pid != self.pids[index]:
                    self.restarts += 1
                    self.incarnations[index] += 1
                    self.sequences[index] = 0
                    log.warning("ray actor %d was restarted (pid %d -> %d)", index, self.pids[index], pid)
                self.pids[index] = pid
                self.last_version[index] = int(data["version"].max())
                self.started[index] = True
                self.sequences[index] += 1
                return Chunk(
                    {name: torch.from_numpy(array.copy()) for name, array in data.items()},
                    index,
                    self.incarnations[index],
                    self.sequences[index],
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no trajectory chunk within {timeout} s")

    def close(self) -> None:
        for actor in self.workers + ([self.server] if self.server is not None else []):
            self.ray.kill(actor, no_restart=True)
        self.workers, self.server, self.pending = [], None, {}
        if self.started_ray:
            self.ray.shutdown()

    def worker_pids(self) -> list[int]:
        return self.ray.get([worker.pid.remote() for worker in self.workers])

    def _kill_hung(self) -> None:
        now = time.monotonic()
        overdue = {
            ref: (index, self._call_limit(index))
            for ref, (index, submitted) in self.pending.items()
            if now - submitted > self._call_limit(index)
        }
        if not overdue:
            return
        # A call that finished while the learner was busy elsewhere (a long update) is not hung.
        finished, _ = self.ray.wait(list(overdue), num_returns=len(overdue), timeout=0)
        for ref in set(overdue) - set(finished):
            index, limit = overdue[ref]
            del self.pending[ref]
            log.warning(
                "ray actor %d did not finish a chunk within %.0f s (hung); killing it for Ray to restart", index, limit
            )
            self.ray.kill(self.workers[index], no_restart=False)
            self.started[index] = False
            self.last_version[index] = -1

    def _call_limit(self, index: int) -> float:
        return self.heartbeat_timeout if self.started[index] else self.startup_timeout

    def _submit_idle(self) -> None:
        if self.weights_ref is None:
            return
        busy = {index for index, _ in self.pending.values()}
        for index, worker in enumerate(self.workers):
            # Synchronous collection: one chunk per worker per version.
            if index in busy or (self.setup.synchronous and self.last_version[index] >= self.version):
                continue
            ref = worker.rollout.remote([self.weights_ref], self.version)
            self.pending[ref] = (index, time.monotonic())


class RayRolloutWorker:
    """A Ray actor stepping ``setup.n_envs`` environments; each ``rollout`` call returns one chunk."""

    def __init__(self, index: int, setup: ActorSetup, policy: Optional[torch.nn.Module], server):
        import ray

        torch.set_num_threads(1)
        # A restarted actor (same constructor arguments) must not replay its predecessor's episodes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray deprecates an API this property uses internally
            incarnation = int(ray.get_runtime_context().was_current_actor_reconstructed)
        seed = setup.worker_seed(index, incarnation)
        torch.manual_seed(seed)
        self.runner = EnvRunner(setup.spec, setup.env_kwargs, setup.n_envs, seed, setup.return_discount)
        self.layout = chunk_layout(setup.spec, setup.steps, setup.n_envs)
        self.local = policy is not None
        self.act = PolicyActor(policy) if self.local else _ServerClient(server)

    def rollout(self, weights: list, version: int) -> tuple[dict[str, np.ndarray], int]:
        import os

        import ray

        if self.local and version > self.act.version:
            for name, array in ray.get(weights[0]).items():
                self.act.state[name].copy_(torch.tensor(array))  # object-store arrays are read-only
            self.act.version = version
        chunk = {name: torch.empty(shape, dtype=dtype).numpy() for name, (shape, dtype) in self.layout.items()}
        self.runner.fill(chunk, self.act)
        return chunk, os.getpid()

    def pid(self) -> int:
        import os

        return os.getpid()


class _ServerClient:
    def __init__(self, server):
        self.server = server

    def __call__(self, obs: np.ndarray, action: np.ndarray, log_prob: np.ndarray, value: np.ndarray) -> int:
        import ray

        action[...], log_prob[...], value[...], version = ray.get(self.server.act.remote(obs))
        return version


class RayInferenceServer:
    """An async Ray actor batching ``act`` calls from all workers: it runs the policy once it holds
    ``max_batch`` observations or ``max_wait`` seconds after the first of a batch arrived."""

    def __init__(self, policy: torch.nn.Module, max_batch: int, max_wait: float, device: str):
        torch.set_num_threads(1)
        self.policy = policy.to(device).eval()
        self.state = self.policy.state_dict()
        self.device, self.max_batch, self.max_wait = device, max_batch, max_wait
        self.version = -1
        self.pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self.batch_id = 0

    async def set_weights(self, weights: list, version: int) -> None:
        if version > self.version:
            for name, array in (await weights[0]).items():
                self.state[name].copy_(torch.tensor(array))
            self.version = version

    async def act(self, obs: np.ndarray):
        while self.version < 0:  # no weights yet
            await asyncio.sleep(0.01)
        future = asyncio.get_running_loop().create_future()
        self.pending.append((obs, future))
        if sum(len(o) for o, _ in self.pending) >= self.max_batch:
            self._flush()
        elif len(self.pending) == 1:
            batch_id = self.batch_id
            asyncio.get_running_loop().call_later(self.max_wait, lambda: self.batch_id == batch_id and self._flush())
        return await future

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        self.batch_id += 1
        obs = torch.from_numpy(np.concatenate([o for o, _ in batch])).to(self.device)
        with torch.inference_mode():
            action, log_prob, value = (t.cpu().numpy() for t in sample_actions(self.policy, obs))
        start = 0
        for o, future in batch:
            stop = start + len(o)
            future.set_result((action[start:stop], log_prob[start:stop], value[start:stop], self.version))
            start = stop
