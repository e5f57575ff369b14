"""Shared-memory image buffers that loader workers reuse, batch after batch.

A batch's images (29 MiB at 3 cameras of 224x224, 2 steps, 32 samples) go from a worker to the
training process in shared memory. A fresh segment per batch costs its creation and a page fault
for every 4 KiB page the worker writes: about a fifth of a worker's time at that size. So each
worker keeps a few segments and fills them again. It may refill one only once the training process
holds no tensor on it any more: the training process watches the storage of each batch it received
and frees the buffer's slot when that storage has gone (all views of it included). A batch kept
(a callback's list, a debugger) keeps its slot, and the worker makes a fresh segment instead of
waiting: reuse never blocks and never overwrites what is still read.

Slots live in a small shared tensor: 0 is free, 1 taken. A worker takes a free slot; only the
training process frees a slot it received. A pass of the loader with new workers gets a new pool;
persistent workers keep theirs, and the slots of batches an earlier pass never handed out (a pass
stopped early: PyTorch discards what its workers had loaded ahead) are freed when the next begins.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

BUFFER_KEY = "buffer_slot"  # per-batch (worker, slot) of a pooled image buffer, removed by the loader


class BatchBufferPool:
    """``slots_per_worker`` reusable image buffers for each of ``n_workers`` loader workers."""

    def __init__(self, n_workers: int, slots_per_worker: int) -> None:
        self.slots = torch.zeros(n_workers, slots_per_worker, dtype=torch.uint8).share_memory_()
        self.allocations = torch.zeros(n_workers, dtype=torch.int64).share_memory_()  # segments made, per worker
        self._buffers: dict[int, torch.Tensor] = {}  # in a worker: slot -> its buffer
        self._lent: dict[tuple[int, int], StorageWeakRef] = {}  # in the training process: slots it holds

    def __getstate__(self) -> dict:
        # Spawned workers get the shared tensors, not this process's buffers or watches.
        return {**self.__dict__, "_buffers": {}, "_lent": {}}

    # ---- in a worker -----------------------------------------------------------------------------

    def take(self, worker: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, int | None]:
        """A uint8 tensor of ``shape`` in shared memory and its slot (None: a fresh, unpooled one).
        ``shape[0]`` samples of a buffer made for the first batch's; a larger batch gets a fresh one."""
        free = (self.slots[worker] == 0).nonzero().flatten().tolist()
        if free:
            slot = free[0]
            buffer = self._buffers.get(slot)
            if buffer is None or buffer.shape[0] < shape[0] or buffer.shape[1:] != shape[1:]:
                buffer = self._buffers[slot] = new_shared(shape)
                self.allocations[worker] += 1
            self.slots[worker, slot] = 1
            return buffer[: shape[0]], slot
        self.allocations[worker] += 1
        return new_shared(shape), None

    def give_back(self, worker: int, slot: int) -> None:
        """Free a slot whose batch was never sent."""
        self.slots[worker, slot] = 0

    # ---- in the training process -----------------------------------------------------------------

    def lend(self, buffer_slot: tuple[int, int], images: torch.Tensor) -> None:
        """Watch the received ``images`` of a pooled buffer: its slot is freed once they are gone."""
        self._lent[tuple(buffer_slot)] = StorageWeakRef(images.untyped_storage())

    def collect(self) -> None:
        """Free the slots of received batches that nothing refers to any more."""
        for key in [key for key, ref in self._lent.items() if ref.expired()]:
            del self._lent[key]
            self.slots[key] = 0

    def free_unreceived(self) -> None:
        """Before persistent workers resume for a new pass: free every slot not held here. The batches
        of the last pass that were not handed out are discarded, never read."""
        self.collect()
        held = torch.zeros(self.slots.shape, dtype=torch.bool)
        for worker, slot in self._lent:
            held[worker, slot] = True
        self.slots.masked_fill_(~held, 0)


def new_shared(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor of ``shape`` in a new shared-memory segment."""
    # Made shared, as torch's own collate does, not moved there: share_memory_() would copy the
    # whole batch into a new segment.
    storage = torch.UntypedStorage._new_shared(int(torch.Size(shape).numel()))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
