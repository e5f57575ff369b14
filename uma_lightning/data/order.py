"""The order in which an epoch visits samples: a function of the seed and the epoch alone.

Neither the number of loader workers nor the number of ranks changes it (as in MosaicML
Streaming), so a run resumed with other worker or rank counts sees the same samples in the same
order. The order is computed on sample indices only (no data is read), in these steps:

1. Each dataset's shards (data files; one per episode in LeRobot v2.1) are shuffled, and the
   episodes within each shard; the episodes' frames, in order, make the dataset's sample stream.
2. The stream is cut into `partitions` equal parts. A partition reads a contiguous run of shards,
   so a worker serving it touches few files at a time and can prefetch the next ones.
3. With several datasets, each partition draws the dataset of every sample at random with the
   mixture weights and takes that dataset's next sample (a dataset that runs out starts a new
   pass with a new shuffle).
4. A shuffle buffer of `shuffle_buffer` samples shuffles each partition's stream locally.
5. Each partition is cut into batches; global batch b is batch b // P of partition b % P.

Rank r of R gets global batches r, r + R, r + 2R, ...; loader worker w of W gets every W-th of
those. Unshuffled orders (validation) keep the datasets' natural order in one partition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SourceLayout:
    """What the order needs to know of one dataset: samples per episode, and episodes grouped by shard."""

    lengths: tuple[int, ...]  # samples of each selected episode, in row order
    shards: tuple[tuple[int, ...], ...]  # positions into `lengths`, grouped by the file that holds them

    @property
    def n_samples(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class OrderSettings:
    """How the training order is made: the ``order`` section of ``RobotDataModule``.

    Args:
        seed: Seed of the shuffles and mixture draws.
        partitions: Parts the order is cut into; workers and ranks read whole parts at a time. Part
            of the order's definition: keep it to resume with other worker or rank counts.
        shuffle_buffer: Samples in each partition's shuffle buffer (0 or 1: no sample-level shuffle).
        samples_per_epoch: Samples in an epoch; None: all samples of all datasets once.
    """

    seed: int = 0
    partitions: int = 1
    shuffle_buffer: int = 256
    samples_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if self.partitions < 1 or self.shuffle_buffer < 0:
            raise ValueError(
                f"need partitions >= 1 and shuffle_buffer >= 0, got {self.partitions}, {self.shuffle_buffer}"
            )


@dataclass(frozen=True, kw_only=True)
class OrderConfig(OrderSettings):
    """An order of batches: the settings, and what the data module fixes (batch size, mixture weights;
    validation's order is neither shuffled nor cut)."""

    batch_size: int
    shuffle: bool = True
    drop_last: bool = True
    weights: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"need batch_size >= 1, got {self.batch_size}")
        if not self.weights or any(w < 0 or not math.isfinite(w) for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"mixture weights must be finite, >= 0 and not all 0, got {list(self.weights)}")


class EpochOrder:
    """The batches of one epoch: `batch(b)` gives (dataset index, row) arrays of global batch b."""

    def __init__(self, sources: Sequence[SourceLayout], config: OrderConfig, epoch: int) -> None:
        if len(config.weights) != len(sources):
            raise ValueError(f"{len(sources)} datasets but {len(config.weights)} mixture weights")
        self.sources = list(sources)
        self.config = config
        self.epoch = epoch
        total = config.samples_per_epoch or sum(s.n_samples for s in sources)
        batch = config.batch_size
        if config.shuffle:
            # Small datasets get fewer partitions, so that every partition still fills a batch.
            self.partitions = max(1, min(config.partitions, total // batch))
        else:
            self.partitions = 1
        self.per_partition = total // self.partitions
        per_partition_batches = (
            self.per_partition // batch if config.drop_last else math.ceil(self.per_partition / batch)
        )
        self.n_batches = per_partition_batches * self.partitions
        self._cached: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._source_orders: dict[tuple[int, int], np.ndarray] = {}

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= b < self.n_batches:
            raise IndexError(f"batch {b} out of range for {self.n_batches} batches in epoch {self.epoch}")
        partition, k = b % self.partitions, b // self.partitions
        datasets, rows = self.partition(partition)
        size = self.config.batch_size
        return datasets[k * size : (k + 1) * size], rows[k * size : (k + 1) * size]

    def partition(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index, row) of every sample of partition p, in order."""
        if p not in self._cached:
            self._cached[p] = self._build(p)
        return self._cached[p]

    # ---- internals ---------------------------------------------------------------------------

    def _rng(self, *tags: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, self.epoch, *tags])

    def _build(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.per_partition
        if not self.config.shuffle:
            datasets = np.concatenate([np.full(s.n_samples, d) for d, s in enumerate(self.sources)])
            rows = np.concatenate([np.arange(s.n_samples) for s in self.sources])
            return datasets[:n], rows[:n]
        if len(self.sources) == 1:
            datasets, rows = np.zeros(n, dtype=np.int64), self._source_part(0, p, n)
        else:
            weights = np.asarray(self.config.weights, dtype=np.float64)
            datasets = self._rng(2, p).choice(len(self.sources), size=n, p=weights / weights.sum())
            rows = np.empty(n, dtype=np.int64)
            for d in range(len(self.sources)):
                where = np.flatnonzero(datasets == d)
                rows[where] = self._source_part(d, p, len(where))
        order = buffer_shuffle(n, self.config.shuffle_buffer, self._rng(3, p))
        return datasets[order], rows[order]

    def _source_part(self, d: int, p: int, count: int) -> np.ndarray:
        """The first `count` rows of dataset d's part p, continuing into new passes when it runs out."""
        size = self.sources[d].n_samples // self.partitions
        if size == 0:
            raise ValueError(
                f"dataset {d} has {self.sources[d].n_samples} samples, fewer than the {self.partitions} partitions"
            )
        parts, taken, passes = [], 0, 0
        while taken < count:
            stream = self._source_order(d, passes)
            part = stream[p * size : (p + 1) * size]
            parts.append(part[: count - taken])
            taken += len(parts[-1])
            passes += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _source_order(self, d: int, passes: int) -> np.ndarray:
        """Dataset d's rows with its shards shuffled, and the episodes within each shard."""
        key = (d, passes)
        if key not in self._source_orders:
            source = self.sources[d]
            rng = self._rng(1, d, passes)
            episodes = [
                e for shard in rng.permutation(len(source.shards)) for e in rng.permutation(source.shards[shard])
            ]
            lengths = np.asarray(source.lengths, dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            self._source_orders[key] = concatenated_ranges(starts[episodes], lengths[episodes])
        return self._source_orders[key]


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)]), without the Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - run_starts, lengths) + np.arange(total)


def buffer_shuffle(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """The permutation of range(n) a shuffle buffer of `size` produces: items enter in order, and once
    the buffer is full each new item replaces a random one, which leaves; the rest leave in random order."""
    if size <= 1 or n <= 1:
        return np.arange(n)
    size = min(size, n)
    picks = rng.integers(0, size, n).tolist()
    buffer = list(range(size))
    out = []
    for incoming in range(size, n):
        slot = picks[incoming]
        out.append(buffer[slot])
        buffer[slot] = incoming
    return np.concatenate([np.asarray(out, dtype=np.int64), rng.permutation(np.asarray(buffer, dtype=np.int64))])
