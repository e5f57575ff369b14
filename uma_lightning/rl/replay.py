"""Replay buffer: a fixed-capacity ring of transitions, sampled uniformly or by priority.

Prioritized sampling (Schaul et al. 2016) keeps ``priority ** alpha`` of every slot in a sum-tree:
leaves hold the values, each inner node the sum of its two children, so sampling proportionally
is a walk from the root (log2(capacity) vectorised steps for a whole batch) and so is an update.
Samples come with importance weights ``(size * P(i)) ** -beta``, divided by the batch maximum.

Storage, positions and the tree live in shared memory and every operation holds one
inter-process lock, so the buffer can be handed to other processes (writers on one side, the
learner sampling on the other) and stay consistent. ``state_dict`` captures the contents, the
write position, the tree and the sampler's generator, so a learner restored from a checkpoint
draws exactly the samples it would have drawn.
"""

from __future__ import annotations

import math
import multiprocessing

import torch

from uma_lightning.rl.shared import Layout, SharedArrays

# meta layout: [write position, number of stored transitions]
_POSITION, _SIZE = 0, 1


class ReplayBuffer:
    def __init__(
        self,
        capacity: int,
        layout: Layout,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        seed: int = 0,
    ):
        """
        Args:
            capacity: Transitions kept; the oldest are overwritten first.
            layout: Name -> (shape of one transition's field, dtype).
            prioritized: Sample by priority instead of uniformly.
            alpha: How strongly priorities skew sampling (0: uniform).
            beta: Importance-weight exponent (1: fully corrects the sampling bias).
            eps: Added to every priority so no transition becomes impossible to draw.
            seed: Seed of the sampler's generator.
        """
        if capacity < 1:
            raise ValueError(f"replay buffer capacity must be >= 1, got {capacity}")
        self.capacity, self.prioritized = capacity, prioritized
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.field_layout = dict(layout)
        self.storage = SharedArrays({name: ((capacity, *shape), dtype) for name, (shape, dtype) in layout.items()})
        self.meta = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.leaves = 1 << max(math.ceil(math.log2(capacity)), 0)
        self.tree = torch.zeros(2 * self.leaves, dtype=torch.float64).share_memory_() if prioritized else None
        self.max_priority = torch.ones(1, dtype=torch.float64).share_memory_()
        self.lock = multiprocessing.get_context("spawn").Lock()
        self.generator = torch.Generator().manual_seed(seed)

    def __getstate__(self) -> dict:
        # Shared tensors travel as handles; the generator as plain bytes (torch cannot share its state
        # tensor), so every process gets its own copy of the sampler.
        state = dict(self.__dict__)
        state["generator"] = bytes(self.generator.get_state().numpy())
        return state

    def __setstate__(self, state: dict) -> None:
        generator = torch.Generator()
        generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        self.__dict__.update(state, generator=generator)

    def __len__(self) -> int:
        return int(self.meta[_SIZE])

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Append transitions (every field ``[n, ...]``); new ones get the highest priority seen so far."""
        n = next(iter(batch.values())).shape[0]
        if set(batch) != set(self.field_layout):
            raise ValueError(f"replay buffer fields are {sorted(self.field_layout)}, got {sorted(batch)}")
        offset = max(n - self.capacity, 0)  # more than fits: only the newest survive
        with self.lock:
            position = int(self.meta[_POSITION])
            slots = (torch.arange(n - offset) + position) % self.capacity
            for name, values in batch.items():
                self.storage[name][slots] = values[offset:].to(self.storage[name].dtype)
            if self.tree is not None:
                self._set_priorities(slots, self.max_priority.expand(len(slots)))
            self.meta[_POSITION] = (position + n - offset) % self.capacity
            self.meta[_SIZE] = min(int(self.meta[_SIZE]) + n - offset, self.capacity)

    def sample(self, batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(transitions, indices, importance weights)``; weights are all ones for uniform sampling."""
        with self.lock:
            size = int(self.meta[_SIZE])
            if size == 0:
                raise RuntimeError("cannot sample from an empty replay buffer")
            if self.tree is None:
                indices = torch.randint(0, size, (batch_size,), generator=self.generator)
                weights = torch.ones(batch_size)
            else:
                indices, weights = self._sample_proportional(batch_size, size)
            transitions = {name: tensor[indices] for name, tensor in self.storage.tensors.items()}
        return transitions, indices, weights

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set the priorities (e.g. absolute TD errors) of sampled transitions."""
        if self.tree is None:
            return
        priorities = priorities.detach().double().cpu().abs() + self.eps
        with self.lock:
            self.max_priority.copy_(torch.maximum(self.max_priority, priorities.max()))
            self._set_priorities(indices.cpu(), priorities)

    # ---- sum-tree ------------------------------------------------------------------------------

    def _set_priorities(self, slots: torch.Tensor, priorities: torch.Tensor) -> None:
        # Keep the last value of repeated slots, so the result does not depend on scatter order.
        unique, last = _last_occurrence(slots)
        nodes = unique + self.leaves
        self.tree[nodes] = priorities[last].double() ** self.alpha
        while nodes[0] > 1:
            # Repeated parents get the same sum written twice, so no de-duplication is needed.
            nodes = nodes // 2
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]

    def _sample_proportional(self, batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.tree[1]
        # Stratified: one draw in each of batch_size equal slices of the total mass.
        u = torch.arange(batch_size, dtype=torch.float64) + torch.rand(
            batch_size, dtype=torch.float64, generator=self.generator
        )
        u = (u / batch_size * total).clamp(max=total * (1 - 1e-12))
        nodes = torch.ones(batch_size, dtype=torch.int64)
        while nodes[0] < self.leaves:
            left = self.tree[2 * nodes]
            right = u > left
            u = torch.where(right, u - left, u)
            nodes = 2 * nodes + right
        indices = (nodes - self.leaves).clamp(max=size - 1)
        probabilities = self.tree[indices + self.leaves] / total
        weights = (size * probabilities) ** (-self.beta)
        return indices, (weights / weights.max()).float()

    # ---- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        with self.lock:
            size = int(self.meta[_SIZE])
            return {
                "capacity": self.capacity,
                "prioritized": self.prioritized,
                "alpha": self.alpha,
                "position": int(self.meta[_POSITION]),
                "size": size,
                "storage": {name: tensor[:size].clone() for name, tensor in self.storage.tensors.items()},
                "tree": None if self.tree is None else self.tree.clone(),
                "max_priority": float(self.max_priority),
                "generator": self.generator.get_state(),
            }

    def load_state_dict(self, state: dict) -> None:
        for key in ("capacity", "prioritized", "alpha"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"replay buffer in checkpoint has {key}={state[key]!r}, this buffer has {getattr(self, key)!r}"
                )
        stored = {name: (tuple(t.shape[1:]), t.dtype) for name, t in state["storage"].items()}
        if stored != self.field_layout:
            raise ValueError(
                f"replay buffer in checkpoint holds fields {stored}, this buffer holds {self.field_layout}"
            )
        with self.lock:
            size = state["size"]
            for name, tensor in state["storage"].items():
                self.storage[name][:size] = tensor
            self.meta[_POSITION], self.meta[_SIZE] = state["position"], size
            if self.tree is not None:
                self.tree.copy_(state["tree"])
            self.max_priority.fill_(state["max_priority"])
            self.generator.set_state(state["generator"])


def _last_occurrence(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values and the position of each one's last occurrence in ``values``."""
    unique, inverse = torch.unique(values, return_inverse=True)
    positions = torch.arange(len(values))
    return unique, torch.full((len(unique),), -1, dtype=torch.int64).scatter_reduce(
        0, inverse, positions, reduce="amax"
    )
