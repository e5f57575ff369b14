"""Versioned policy weights in shared memory: one writer (the learner), any number of readers (actors).

There are two slots. The learner writes the slot readers are not pointed at and then points them at
it, so a publish never waits for an actor and an actor never waits for the learner. Each slot has a
sequence number that is odd while the slot is being written; a reader that sees it change during
its copy copies again (a seqlock), so it never loads half of one version and half of another. No
lock is held across processes, so an actor killed mid-copy cannot block anyone.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from uma_lightning.rl.shared import SharedArrays

# control layout: [latest slot, version of slot 0, version of slot 1, sequence of slot 0, sequence of slot 1]
_LATEST, _VERSION, _SEQUENCE = 0, 1, 3


class WeightStore:
    def __init__(self, state: dict[str, torch.Tensor]):
        layout = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        self.slots = [SharedArrays(layout), SharedArrays(layout)]
        self.control = torch.tensor([-1, -1, -1, 0, 0], dtype=torch.int64).share_memory_()

    def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Make ``state`` the newest weights, tagged ``version`` (must grow with every publish)."""
        control = self.control.numpy()
        layout = self.slots[0].layout
        if set(state) != set(layout) or any(tuple(state[k].shape) != layout[k][0] for k in layout):
            raise ValueError(
                "published weights do not match the policy the actors were started with (names or shapes differ)"
            )
        if version <= self.version:
            raise ValueError(f"policy version must grow: publishing {version} after {self.version}")
        slot = 1 if control[_LATEST] == 0 else 0
        control[_SEQUENCE + slot] += 1  # odd: being written
        for name, tensor in state.items():
            self.slots[slot][name].copy_(tensor.detach())
        control[_VERSION + slot] = version
        control[_SEQUENCE + slot] += 1  # even: complete
        control[_LATEST] = slot

    @property
    def version(self) -> int:
        """The newest published version, -1 before the first publish."""
        control = self.control.numpy()
        slot = int(control[_LATEST])
        return -1 if slot < 0 else int(control[_VERSION + slot])

    def read_into(self, target: dict[str, torch.Tensor], have_version: int) -> Optional[int]:
        """Copy the newest weights into ``target`` (e.g. ``module.state_dict()``) if they are newer than
        ``have_version``; returns the version copied, or None when there is nothing newer."""
        control = self.control.numpy()
        while True:
            slot = int(control[_LATEST])
            if slot < 0:
                return None
            sequence = int(control[_SEQUENCE + slot])
            if sequence % 2:
                time.sleep(0)  # the learner is rewriting this slot; it points readers elsewhere when done
                continue
            version = int(control[_VERSION + slot])
            if version <= have_version:
                return None
            for name, tensor in target.items():
                tensor.copy_(self.slots[slot][name])
            if int(control[_SEQUENCE + slot]) == sequence:
                return version
