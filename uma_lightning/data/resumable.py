"""A train loader whose position within an epoch is checkpointed, so a resumed run sees the same batches.

Stand-in until the data pipeline has its own stateful loader. Two pieces:

- ``EpochShuffle``: a random order that is a function of (seed, epoch) only, so any epoch's order can
  be drawn again after a restart (Lightning calls ``set_epoch``; under DDP it substitutes a
  ``DistributedSampler``, which has the same property).
- ``ResumableDataLoader``: a DataLoader with ``state_dict``/``load_state_dict``, which Lightning's fit
  loop saves and restores. The state is the epoch and the number of batches training consumed; on
  resume the consumed batches are skipped as index lists, without loading them.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, RandomSampler


class EpochShuffle(RandomSampler):
    """A permutation of the dataset per epoch, drawn from ``seed + epoch``."""

    def __init__(self, data_source, seed: int = 0):
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class ResumableDataLoader(DataLoader):
    """A DataLoader (same arguments) that can continue an epoch from a saved position.

    A batch counts as consumed when it is handed out: Lightning's training loop fetches ahead only
    from loaders without a length, so when it saves at a batch end it has trained on every batch
    this loader handed out.
    """

    _resume: Optional[dict] = None
    _epoch = 0
    _skip = 0
    _consumed = 0

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "batches": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        # A save right after the last batch of an epoch resumes at the start of the next one.
        self._resume = {"epoch": epoch + 1, "batches": 0} if batches >= len(self) else {"epoch": epoch, "batches": batches}

    def __iter__(self):
        resume, self._resume = self._resume, None
        sampler = getattr(self.batch_sampler, "sampler", self.sampler)
        if resume is not None and hasattr(sampler, "set_epoch"):
            # Lightning sets the epoch only after a resumed loader has started iterating.
            sampler.set_epoch(resume["epoch"])
        self._epoch = getattr(sampler, "epoch", 0)
        self._skip = self._consumed = resume["batches"] if resume is not None else 0
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    @property
    def _index_sampler(self):
        return _SkipFirst(super()._index_sampler, self)


class _SkipFirst:
    """The loader's batch index lists, without the first ``loader._skip`` of them on the next pass."""

    def __init__(self, indices, loader: ResumableDataLoader):
        self.indices, self.loader = indices, loader

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        skip, self.loader._skip = self.loader._skip, 0
        iterator = iter(self.indices)
        for _ in range(skip):
            next(iterator, None)
        yield from iterator
