"""Rollout workers as processes on this machine, supervised by the learner.

Each worker steps a vector of environments and writes trajectory chunks into its own preallocated
shared-memory slots; the learner is told which slot is ready through a pipe, copies it out with one
memcpy and hands the slot back. Nothing is pickled per step.

Workers start from a forkserver and skip importing the learner's main module, unless the policy's
class is defined there; then, as with any spawned process, the script must guard its entry point
with ``if __name__ == "__main__":``.

Supervision happens while the learner asks for data: a worker that exited, or whose heartbeat (a
timestamp it writes into shared memory every step and while it waits) is older than
``heartbeat_timeout``, is killed and started again with fresh environments. The chunk it was
filling is discarded: only slots it announced as complete are ever read. The same holds for the
inference server, whose waiting workers re-send their requests to its new incarnation.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import sys
import time
import types
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Optional

import torch
import torch.multiprocessing

from uma_lightning.rl.env import EnvSpec
from uma_lightning.rl.inference import ServerClient, ServerLink, make_links, serve
from uma_lightning.rl.rollout import EnvRunner, PolicyActor, chunk_layout
from uma_lightning.rl.shared import SharedArrays, recv_message, send_message
from uma_lightning.rl.weights import WeightStore
from uma_lightning.stop_signals import ignore_stop_signals

log = logging.getLogger("uma_lightning")

_MAX_FAILED_STARTS = 3


@dataclass(frozen=True)
class ActorSetup:
    """What every rollout worker needs to know, whatever the backend."""

    spec: EnvSpec
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    n_envs: int = 8
    steps: int = 64
    seed: int = 0
    synchronous: bool = False  # wait for a new policy version before each chunk
    return_discount: float = 0.99

    def worker_seed(self, index: int, incarnation: int) -> int:
        # A restarted worker gets new seeds, so it does not replay the episodes of its predecessor.
        return self.seed + 7919 * index + 1_000_003 * incarnation


@dataclass
class Chunk:
    data: dict[str, torch.Tensor]
    worker: int
    incarnation: int
    sequence: int


@dataclass
class _Process:
    index: int
    incarnation: int
    process: Any
    started: float
    ready: Any = None  # learner's read end: "slot s is complete"
    free: Any = None  # learner's write end: "slot s is yours again"


class LocalActors:
    def __init__(
        self,
        setup: ActorSetup,
        policy: torch.nn.Module,
        n_workers: int,
        slots_per_worker: int = 2,
        server: Optional[dict[str, Any]] = None,
        heartbeat_timeout: float = 60.0,
        startup_timeout: float = 300.0,
    ):
        """
        Args:
            setup: Environments and chunk size of every worker.
            policy: The policy to act with; a CPU copy is sent to each worker (or to the server) once, at start.
            n_workers: Worker processes.
            slots_per_worker: Chunks a worker may have written and not yet had consumed; it waits when all are full.
            server: None for per-worker inference, else ``{"max_batch", "max_wait", "device"}`` of a central server.
            heartbeat_timeout: Seconds without a heartbeat after which a started worker counts as hung.
            startup_timeout: Seconds a new worker may take to import and build its environments.
        """
        self.ctx = process_context()
        self.setup, self.n_workers = setup, n_workers
        self.heartbeat_timeout, self.startup_timeout = heartbeat_timeout, startup_timeout
        self.policy = copy.deepcopy(policy).cpu()
        self.weights = WeightStore(self.policy.state_dict())
        # One heartbeat per worker, one for the server, and a last element set to ask every process to stop.
        self.heartbeats = torch.zeros(n_workers + 2, dtype=torch.float64).share_memory_()
        # Only this process holds the writing end: children see end-of-file when it is gone.
        self._lifeline_reader, self._lifeline_writer = self.ctx.Pipe(duplex=False)
        layout = chunk_layout(setup.spec, setup.steps, setup.n_envs)
        self.slots = [[SharedArrays(layout) for _ in range(slots_per_worker)] for _ in range(n_workers)]
        self.server_config = server
        self.links: Optional[list[ServerLink]] = None
        self.server: Optional[_Process] = None
        if server is not None:
            self.links = make_links(self.ctx, n_workers, setup.n_envs, setup.spec.obs_dim, setup.spec.action_dim)
            self.server = self._start_server(0)
        self.restarts = 0
        self.failed_starts = [0] * n_workers
        self._next_worker = 0
        self._last_check = 0.0
        self.workers = [self._start_worker(index, 0) for index in range(n_workers)]

    # ---- learner side ----------------------------------------------------------------------------

    def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.weights.publish(state, version)

    def next_chunk(self, timeout: Optional[float] = None) -> Chunk:
        """The next complete chunk from any worker (round robin among those ready); restarts dead or
        hung processes while it waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if time.monotonic() - self._last_check > 0.5:
                self._supervise()
            by_conn = {worker.ready: worker for worker in self.workers}
            ready = wait(list(by_conn), timeout=0.2)
            for worker in sorted(
                (by_conn[c] for c in ready), key=lambda w: (w.index - self._next_worker) % self.n_workers
            ):
                message = recv_message(worker.ready)
                if message is None:
                    self._restart_worker(worker, f"exited with code {_exitcode(worker.process)}")
                    continue
                slot, sequence = message
                data = self.slots[worker.index][slot].copy()
                try:
                    send_message(worker.free, slot)
                except BrokenPipeError:
                    self._restart_worker(worker, f"exited with code {_exitcode(worker.process)}")
                self._next_worker = (worker.index + 1) % self.n_workers
                return Chunk(data, worker.index, worker.incarnation, sequence)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no trajectory chunk within {timeout} s")

    def close(self) -> None:
        """Stop every process (they exit at their next heartbeat); stragglers are killed."""
        processes = list(self.workers) + ([self.server] if self.server else [])
        self.heartbeats[-1] = 1.0
        for worker in self.workers:
            worker.free.close()
            worker.ready.close()
        for proc in processes:
            proc.process.join(timeout=5)
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(timeout=5)
        self._lifeline_reader.close()
        self._lifeline_writer.close()
        if self.links is not None:
            for link in self.links:
                for conn in (link.request_reader, link.request_writer, link.response_reader, link.response_writer):
                    conn.close()
        self.workers, self.server, self.links = [], None, None

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self.workers]

    # ---- supervision ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        self._last_check = now = time.monotonic()
        beats = self.heartbeats.numpy()
        for worker in list(self.workers):
            if reason := self._problem(worker, beats[worker.index], now):
                self._restart_worker(worker, reason)
        if self.server is not None and (reason := self._problem(self.server, beats[self.n_workers], now)):
            log.warning("inference server (pid %d) %s; restarting it", self.server.process.pid, reason)
            self._kill(self.server)
            self.restarts += 1
            self.server = self._start_server(self.server.incarnation + 1)

    def _problem(self, proc: _Process, beat: float, now: float) -> Optional[str]:
        if not proc.process.is_alive():
            return f"exited with code {_exitcode(proc.process)}"
        if beat == 0.0 and now - proc.started > self.startup_timeout:
            return f"did not start within {self.startup_timeout:.0f} s"
        if beat > 0.0 and now - beat > self.heartbeat_timeout:
            return f"sent no heartbeat for {now - beat:.1f} s (hung)"
        return None

    def _restart_worker(self, worker: _Process, reason: str) -> None:
        if self.workers[worker.index] is not worker:
            return  # already replaced
        log.warning(
            "actor %d (pid %d, incarnation %d) %s; restarting it and discarding its unfinished chunk",
            worker.index,
            worker.process.pid,
            worker.incarnation,
            reason,
        )
        self._kill(worker)
        # A worker that dies before its first heartbeat fails at start-up (bad env, import error):
        # restarting it forever would hide that, so give up after a few attempts in a row.
        started = self.heartbeats[worker.index] > 0
        self.failed_starts[worker.index] = 0 if started else self.failed_starts[worker.index] + 1
        if self.failed_starts[worker.index] >= _MAX_FAILED_STARTS:
            self.close()
            raise RuntimeError(
                f"actor {worker.index} failed to start {_MAX_FAILED_STARTS} times in a row ({reason}); "
                "its error is printed above"
            )
        worker.ready.close()
        worker.free.close()
        self.restarts += 1
        self.workers[worker.index] = self._start_worker(worker.index, worker.incarnation + 1)

    @staticmethod
    def _kill(proc: _Process) -> None:
        proc.process.kill()
        proc.process.join(timeout=10)

    def _start_worker(self, index: int, incarnation: int) -> _Process:
        ready_reader, ready_writer = self.ctx.Pipe(duplex=False)
        free_reader, free_writer = self.ctx.Pipe(duplex=False)
        self.heartbeats[index] = 0.0
        link = self.links[index] if self.links is not None else None
        process = self.ctx.Process(
            target=_worker_main,
            args=(
                index,
                incarnation,
                self.setup,
                None if link else self.policy,
                self.weights,
                self.slots[index],
                ready_writer,
                free_reader,
                self.heartbeats,
                self._lifeline_reader,
                link,
            ),
            name=f"uma-actor-{index}",
            daemon=True,
        )
        with _main_module_left_out(self.policy):
            process.start()
        # Keep only the learner's ends open here, so the worker's death shows as end-of-file.
        ready_writer.close()
        free_reader.close()
        for slot in range(len(self.slots[index])):
            send_message(free_writer, slot)
        return _Process(index, incarnation, process, time.monotonic(), ready_reader, free_writer)

    def _start_server(self, incarnation: int) -> _Process:
        config = self.server_config
        self.heartbeats[self.n_workers] = 0.0
        if incarnation:
            self.links[0].generation += 1  # shared by all links: waiting workers re-send their requests
        process = self.ctx.Process(
            target=_server_main,
            args=(
                self.policy,
                self.weights,
                self.links,
                self.heartbeats,
                self._lifeline_reader,
                self.n_workers,
                config["max_batch"],
                config["max_wait"],
                config["device"],
            ),
            name="uma-inference-server",
            daemon=True,
        )
        with _main_module_left_out(self.policy):
            process.start()
        return _Process(self.n_workers, incarnation, process, time.monotonic())


def process_context():
    """Workers fork from a forkserver: a clean single-threaded process that imported torch and
    gymnasium once, so starting or restarting a worker costs a fork, not a Python start-up, and no
    thread of the learner (loggers, OpenMP) is forked with it."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["uma_lightning.forkserver_preload", "uma_lightning.rl.local", "gymnasium"])
    return context


@contextlib.contextmanager
def _main_module_left_out(policy: torch.nn.Module):
    """Start a child without importing the learner's main module into it, as multiprocessing otherwise
    does: under ``uma`` that is the CLI, and importing Lightning would cost every worker start, and
    restart, seconds of CPU. Children need only ``_worker_main`` and importable env factories; a policy
    with a class defined in the main script still needs the script, so then it is imported as usual."""
    if any(type(module).__module__ == "__main__" for module in policy.modules()):
        yield
        return
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __spec__, no __file__: nothing to import
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _exitcode(process) -> str:
    process.join(timeout=1)
    code = process.exitcode
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _child_setup() -> None:
    """A child ignores Ctrl+C and the scheduler's stop signals (the learner decides when it stops,
    and ends it with SIGKILL or through the lifeline) and uses one thread."""
    ignore_stop_signals()
    torch.set_num_threads(1)


class _Pulse:
    """Called every step and while waiting: writes the heartbeat, and ends the process when the learner
    asked every process to stop or is gone. A killed learner cannot ask; its end of the lifeline pipe
    closes with it (its parent pid would not tell: workers are children of the forkserver)."""

    LIFELINE_INTERVAL = 0.05  # seconds between polls of the lifeline: a system call, too dear for every step

    def __init__(self, heartbeats: torch.Tensor, index: int, lifeline):
        self.beats, self.index, self.lifeline = heartbeats.numpy(), index, lifeline
        self.next_poll = 0.0

    def __call__(self) -> None:
        now = self.beats[self.index] = time.monotonic()
        if self.beats[-1]:
            raise SystemExit(0)
        if now >= self.next_poll:
            self.next_poll = now + self.LIFELINE_INTERVAL
            if self.lifeline.poll():
                raise SystemExit(0)


def _worker_main(
    index: int,
    incarnation: int,
    setup: ActorSetup,
    policy: Optional[torch.nn.Module],
    weights: WeightStore,
    slots: list[SharedArrays],
    ready,
    free,
    heartbeats: torch.Tensor,
    lifeline,
    link: Optional[ServerLink],
) -> None:
    _child_setup()
    heartbeat = _Pulse(heartbeats, index, lifeline)
    seed = setup.worker_seed(index, incarnation)
    torch.manual_seed(seed)
    runner = EnvRunner(setup.spec, setup.env_kwargs, setup.n_envs, seed, setup.return_discount)
    # The policy arrives with its tensors in shared memory, mapped by every process it was sent to;
    # a private copy keeps this worker's weights its own until it loads a new version.
    act = PolicyActor(copy.deepcopy(policy)) if link is None else ServerClient(link, incarnation, heartbeat)
    last_version, sequence = -1, 0
    heartbeat()
    try:
        while True:
            while not free.poll(0.05):
                heartbeat()
            message = recv_message(free)
            if message is None:
                return  # the learner closed the pipe: shut down
            # Act only with published weights; in synchronous mode, with a version newer than the last chunk's.
            required = last_version + 1 if setup.synchronous else 0
            while weights.version < required:
                heartbeat()
                time.sleep(0.001)
            if link is None:
                version = weights.read_into(act.state, act.version)
                act.version = act.version if version is None else version
            arrays = slots[message[0]].arrays
            runner.fill(arrays, act, heartbeat)
            last_version = int(arrays["version"].max())
            sequence += 1
            send_message(ready, message[0], sequence)
    except (BrokenPipeError, EOFError):
        return  # the learner is gone
    finally:
        runner.close()


def _server_main(policy, weights, links, heartbeats, lifeline, beat_index, max_batch, max_wait, device) -> None:
    _child_setup()
    serve(copy.deepcopy(policy), weights, links, _Pulse(heartbeats, beat_index, lifeline), max_batch, max_wait, device)
