"""A central inference server for large policies, as in SEED RL: workers only step environments.

Each worker writes its observations into its own shared-memory request buffer and sends a tag on
a pipe. The server waits for the first request, then for more until ``max_batch`` observations or
``max_wait`` seconds, runs the policy once on the whole batch (on the accelerator when there is
one), writes every worker's actions into its response buffer and sends the tag back.

Pipes and buffers belong to the parent and outlive the processes, so a restarted worker or server
takes over the same ones. Tags carry the worker's incarnation and a counter: replies meant for a
dead incarnation, or duplicates, are recognised and ignored. When the server is restarted
(``generation`` changes) a waiting worker sends its request again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np
import torch

from uma_lightning.rl.rollout import sample_actions
from uma_lightning.rl.shared import SharedArrays, recv_message, send_message
from uma_lightning.rl.weights import WeightStore


@dataclass
class ServerLink:
    """One worker's connection to the server: buffers and both ends of two pipes."""

    request: SharedArrays  # obs [n_envs, obs_dim]
    response: SharedArrays  # action [n_envs, A], log_prob [n_envs], value [n_envs], version [1]
    request_reader: object
    request_writer: object
    response_reader: object
    response_writer: object
    generation: torch.Tensor  # shared int64 [1]: server incarnation


def make_links(ctx, n_workers: int, n_envs: int, obs_dim: int, action_dim: int) -> list[ServerLink]:
    generation = torch.zeros(1, dtype=torch.int64).share_memory_()
    links = []
    for _ in range(n_workers):
        request_reader, request_writer = ctx.Pipe(duplex=False)
        response_reader, response_writer = ctx.Pipe(duplex=False)
        links.append(
            ServerLink(
                request=SharedArrays({"obs": ((n_envs, obs_dim), torch.float32)}),
                response=SharedArrays(
                    {
                        "action": ((n_envs, action_dim), torch.float32),
                        "log_prob": ((n_envs,), torch.float32),
                        "value": ((n_envs,), torch.float32),
                        "version": ((1,), torch.int64),
                    }
                ),
                request_reader=request_reader,
                request_writer=request_writer,
                response_reader=response_reader,
                response_writer=response_writer,
                generation=generation,
            )
        )
    return links


class ServerClient:
    """The worker side: ``act(obs, action, log_prob, value)`` with the same signature as a local ``PolicyActor``."""

    def __init__(self, link: ServerLink, incarnation: int, heartbeat):
        self.link, self.heartbeat = link, heartbeat
        self.tag = incarnation << 32
        self.generation = link.generation.numpy()

    def __call__(self, obs: np.ndarray, action: np.ndarray, log_prob: np.ndarray, value: np.ndarray) -> int:
        link = self.link
        link.request.arrays["obs"][:] = obs
        self.tag += 1
        generation = int(self.generation[0])
        send_message(link.request_writer, self.tag)
        while True:
            if link.response_reader.poll(0.05):
                reply = recv_message(link.response_reader)
                if reply is None:
                    raise EOFError("inference server pipe closed")
                if reply[0] == self.tag:
                    break
                continue  # a reply to an earlier incarnation or a duplicate request
            self.heartbeat()
            if int(self.generation[0]) != generation:  # the server was restarted: ask again
                generation = int(self.generation[0])
                send_message(link.request_writer, self.tag)
        response = link.response.arrays
        action[...], log_prob[...], value[...] = response["action"], response["log_prob"], response["value"]
        return int(response["version"][0])


def serve(
    policy: torch.nn.Module,
    weights: WeightStore,
    links: list[ServerLink],
    heartbeat,
    max_batch: int,
    max_wait: float,
    device: str,
) -> None:
    """The server loop; runs until ``heartbeat()`` raises SystemExit."""
    policy = policy.to(device).eval()
    state, version = policy.state_dict(), -1
    readers = {link.request_reader: index for index, link in enumerate(links)}
    n_envs = [link.request["obs"].shape[0] for link in links]
    while True:
        heartbeat()
        ready = wait(list(readers), timeout=0.2)
        if not ready:
            continue
        pending: dict[int, int] = {}
        _take(ready, readers, pending)
        deadline = time.monotonic() + max_wait
        while sum(n_envs[w] for w in pending) < max_batch and (remaining := deadline - time.monotonic()) > 0:
            others = [conn for conn, w in readers.items() if w not in pending]
            if not others:
                break
            _take(wait(others, timeout=remaining), readers, pending)
        newer = weights.read_into(state, version)
        version = version if newer is None else newer
        order = sorted(pending)
        obs = torch.cat([links[w].request["obs"] for w in order]).to(device, non_blocking=True)
        with torch.inference_mode():
            action, log_prob, value = (t.cpu() for t in sample_actions(policy, obs))
        start = 0
        for w in order:
            response, stop = links[w].response, start + n_envs[w]
            response["action"].copy_(action[start:stop])
            response["log_prob"].copy_(log_prob[start:stop])
            response["value"].copy_(value[start:stop])
            response["version"].fill_(version)
            send_message(links[w].response_writer, pending[w])
            start = stop


def _take(conns, readers: dict, pending: dict[int, int]) -> None:
    for conn in conns:
        message = recv_message(conn)
        if message is not None:
            pending[readers[conn]] = message[0]
