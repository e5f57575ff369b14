"""The resumable batch loader: workers build whole batches in the order of order.py, and the loader's
position (epoch, batches handed out) is its state.

Lightning saves the `state_dict()` of every training dataloader that has `state_dict` and
`load_state_dict` in the fit loop's checkpoint state (``loops.fit_loop.state_dict.combined_loader``)
and restores it before the loader is iterated again. Because the loader has a length, Lightning
fetches each batch only when the step needs it, so "batches handed out" is exactly "batches
trained on" when a checkpoint is written. On resume the workers start at the saved batch, with no
data read for the batches before it.

Worker w of W builds batches w, w + W, ... of its rank's sequence and PyTorch's DataLoader returns
them round-robin, i.e. in sequence order, so the order does not depend on W. The start position
reaches the workers through a small shared-memory tensor, which persistent workers also see when
the next epoch begins.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from uma_lightning.data.batch_buffers import BUFFER_KEY, BatchBufferPool, new_shared
from uma_lightning.data.dataset import BAD_DATA_ERRORS, FrameDataset
from uma_lightning.data.order import EpochOrder, OrderConfig, SourceLayout
from uma_lightning.data.prefetch import DevicePrefetcher
from uma_lightning.stop_signals import LoaderWorkerSignals

logger = logging.getLogger(__name__)

BadDataPolicy = Literal["error", "skip"]
BAD_SAMPLES_KEY = "bad_samples"  # per-batch list of skipped samples' errors, removed by the loader
LOGGED_BAD_SAMPLES = 10  # log this many skipped samples one by one, then every 100th
# Batches the training side holds at once besides the workers' prefetched ones: the step's, the one
# Lightning fetches ahead, the device prefetcher's. A worker's pool has room for those and its own.
BATCHES_HELD_BY_TRAINING = 4
# Batches ahead whose frames a worker's decoded-frame cache keeps before others, in plans: frames
# shared by samples far apart in the order (a shuffle buffer's neighbours) are then decoded once.
# Measured at 3 cameras of 224x224 in 512 MiB: 690 of 7524 conversions were repeats, none with this.
HELD_PLANS = 3


class BatchStream(IterableDataset):
    """Batches of samples from one or more `FrameDataset`s in a seeded order; one rank's share of it."""

    def __init__(
        self,
        sources: Sequence[FrameDataset],
        config: OrderConfig,
        rank: int = 0,
        world_size: int = 1,
        on_bad_data: BadDataPolicy = "error",
        prefetch_batches: int = 2,
        plan_batches: int = 16,
    ) -> None:
        if on_bad_data not in ("error", "skip"):
            raise ValueError(f"on_bad_data must be 'error' or 'skip', got {on_bad_data!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.sources = list(sources)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.on_bad_data = on_bad_data
        self.prefetch_batches = prefetch_batches
        self.plan_batches = plan_batches
        self.layouts = [_layout(source) for source in self.sources]
        shapes = {source.images_shape for source in self.sources}
        if len(shapes) > 1:
            roots = ", ".join(f"{source.metadata.root}: {source.images_shape}" for source in self.sources)
            raise ValueError(
                f"the datasets' samples have different image shapes [steps, cameras, height, width, 3] ({roots}); one batch needs one shape"
            )
        self.images_shape = shapes.pop()
        self.n_batches = EpochOrder(self.layouts, config, epoch=0).n_batches  # the same in every epoch
        self.position = torch.zeros(2, dtype=torch.int64).share_memory_()  # (epoch, first batch), set by the loader
        self.buffer_pool: BatchBufferPool | None = None  # the workers' image buffers, set by the loader

    def __len__(self) -> int:
        # Every rank takes the same number of steps: sharded models run collectives in forward, so a
        # rank with one batch more would wait forever. Without drop_last the ranks past the end wrap
        # round to the first batches (as DistributedSampler pads), so a few samples count twice.
        if self.config.drop_last:
            return self.n_batches // self.world_size
        return -(-self.n_batches // self.world_size)

    def _global_batch(self, local: int) -> int:
        return (local * self.world_size + self.rank) % self.n_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        worker_id, n_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        epoch, start = (int(v) for v in self.position.tolist())
        order = EpochOrder(self.layouts, self.config, epoch)
        mine = range(start + worker_id, len(self), n_workers)
        held: deque[dict[int, list[int]]] = deque()  # rows by source of the batches whose frames are held, in order
        try:
            for k, local in enumerate(mine):
                self._hold_frames(order, mine[k + len(held) : k + HELD_PLANS * self.plan_batches], held)
                self._prefetch_files(order, mine[k + 1 : k + 1 + self.prefetch_batches])
                self._decode_ahead(order, local, mine[k + 1 : k + 1 + self.plan_batches])
                batch = self.batch(order, local)
                self._release_frames(held.popleft())
                yield batch
        finally:  # a pass stopped early leaves no holds behind
            while held:
                self._release_frames(held.popleft())

    def batch(self, order: EpochOrder, local: int) -> dict[str, Any]:
        """This rank's `local`-th batch of the epoch, collated."""
        datasets, rows = order.batch(self._global_batch(local))
        images, slot = self._batch_images(len(rows))
        samples, bad = [], []
        for d, row in zip(datasets.tolist(), rows.tolist()):
            try:
                samples.append(self.sources[d].sample(row, images[len(samples)]))
            except BAD_DATA_ERRORS as error:
                if self.on_bad_data == "error":
                    raise
                bad.append(f"{self.sources[d].metadata.root}: {error}")
        worker = get_worker_info()
        if not samples:  # the loader counts these and moves on, keeping its position in step
            if slot is not None:
                self.buffer_pool.give_back(worker.id, slot)
            return {BAD_SAMPLES_KEY: bad}
        batch = collate(samples, images[: len(samples)])
        if bad:
            batch[BAD_SAMPLES_KEY] = bad
        if slot is not None:
            batch[BUFFER_KEY] = (worker.id, slot)
        return batch

    def _batch_images(self, n_samples: int) -> tuple[torch.Tensor, int | None]:
        """The batch's image tensor, which samples write their frames into, and its slot in the
        buffer pool. In a worker it is in shared memory, so that handing the batch to the training
        process copies no frames again, and one of the worker's reused buffers where one is free."""
        shape = (n_samples, *self.images_shape)
        worker = get_worker_info()
        if worker is not None:
            if self.buffer_pool is None:
                return new_shared(shape), None
            return self.buffer_pool.take(worker.id, shape)
        # numpy's allocation, not torch.empty: numpy asks for transparent huge pages, where first touching
        # a batch's 29 MiB (224x224) in 4 KiB pages took ~7k page faults (440k for 40 batches, 179k now).
        return torch.from_numpy(np.empty(shape, dtype=np.uint8)), None

    def _decode_ahead(self, order: EpochOrder, local: int, later: range) -> None:
        """Decode this batch's frames file by file, in time order, keeping those that this worker's
        next `plan_batches` batches show (see FrameDataset.prepare)."""
        rows, later_rows = self._rows_by_source(order, [local]), self._rows_by_source(order, later)
        for d, source_rows in rows.items():
            try:
                self.sources[d].prepare(source_rows, later_rows.get(d, ()))
            except BAD_DATA_ERRORS:
                pass  # reading the samples meets the error again, and handles it as on_bad_data says

    def _hold_frames(self, order: EpochOrder, entering: range, held: deque[dict[int, list[int]]]) -> None:
        """Hold in the decoded-frame caches the frames of the batches `entering` the held window:
        the caches then let go of frames no batch of the window shows before any the window needs.
        The window stops short where a cache has no room for more (the next call tries again)."""
        for local in entering:
            # Not remote datasets: finding a batch's frames reads its episodes' data files, which would
            # fetch them long before the prefetch does.
            rows = {
                d: r
                for d, r in self._rows_by_source(order, [local]).items()
                if not self.sources[d].metadata.storage.remote
            }
            if held and not all(self.sources[d].room_to_hold() for d in rows):
                return
            for d, source_rows in rows.items():
                try:
                    self.sources[d].hold_frames(source_rows)
                except BAD_DATA_ERRORS:
                    pass  # reading the samples meets the error again, and handles it as on_bad_data says
            held.append(rows)

    def _release_frames(self, rows: dict[int, list[int]]) -> None:
        for d, source_rows in rows.items():
            try:
                self.sources[d].release_frames(source_rows)
            except BAD_DATA_ERRORS:
                pass  # as when they were held

    def _rows_by_source(self, order: EpochOrder, locals_: Sequence[int]) -> dict[int, list[int]]:
        rows_by_source: dict[int, list[int]] = {}
        for local in locals_:
            datasets, rows = order.batch(self._global_batch(local))
            for d, row in zip(datasets.tolist(), rows.tolist()):
                rows_by_source.setdefault(d, []).append(row)
        return rows_by_source

    def _prefetch_files(self, order: EpochOrder, locals_: range) -> None:
        remote = [source for source in self.sources if source.metadata.storage.remote]
        if not remote or not locals_:
            return
        for d, rows in self._rows_by_source(order, locals_).items():
            source = self.sources[d]
            if source.metadata.storage.remote:
                source.metadata.storage.prefetch(source.files_of(rows))


def collate(samples: Sequence[dict[str, Any]], images: torch.Tensor | None = None) -> dict[str, Any]:
    """One batch of samples; `images`, when given, already holds the samples' images stacked."""
    batch = {
        key: images if key == "images" and images is not None else torch.stack([s[key] for s in samples])
        for key, value in samples[0].items()
        if isinstance(value, torch.Tensor)
    }
    batch["instruction"] = [s["instruction"] for s in samples]
    return batch


class RobotDataLoader(DataLoader):
    """A DataLoader over a `BatchStream` whose position survives checkpoints (`state_dict`/`load_state_dict`).

    `resumable=False` (validation) starts every pass from the first batch. With a CUDA `device`,
    batches arrive already on it, copied on a side stream while the previous step runs.
    """

    def __init__(
        self,
        stream: BatchStream,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: Any = None,
        resumable: bool = True,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(
            stream,
            batch_size=None,  # the stream yields whole batches
            num_workers=num_workers,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            worker_init_fn=LoaderWorkerSignals() if num_workers > 0 else None,
            # DataLoader draws its workers' base seed at every iter(): from this generator rather than the
            # training process's, so loading never shifts the random numbers training sees (a resumed
            # run would otherwise draw once more than the uninterrupted one).
            generator=torch.Generator().manual_seed(stream.config.seed),
        )
        self.stream = stream
        self.resumable = resumable
        self.device = device
        self.epoch = 0
        self.batches = 0  # handed out in the current epoch
        self.bad_samples = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.resumable:
            self.epoch, self.batches = 0, 0
        self.stream.position[0], self.stream.position[1] = self.epoch, self.batches
        length = len(self)
        pool = self._buffer_pool_for_pass()
        batches = super().__iter__()
        workers = list(getattr(batches, "_workers", ()))  # torch's worker processes: to say how one died
        if pool is not None:
            batches = _lending(batches, pool)
        if self.device is not None:
            batches = iter(DevicePrefetcher(batches, self.device))
        try:
            for batch in batches:
                self._count_bad(batch.pop(BAD_SAMPLES_KEY, ()))
                self.batches += 1
                if self.batches >= length:
                    self.epoch, self.batches = self.epoch + 1, 0
                if (
                    batch
                ):  # a batch whose every sample was bad is left out (Lightning ends the epoch early if it was the last)
                    yield batch
        except (RuntimeError, ConnectionError, EOFError) as err:
            killed = _killed_worker(err, workers)
            if killed is None:
                raise
            raise killed from err

    def _buffer_pool_for_pass(self) -> BatchBufferPool | None:
        """The workers' image buffers for this pass: new ones with new workers, the same (their
        unreceived slots freed) for persistent workers, which took the pool when they started."""
        if self.num_workers == 0:
            return None
        pool = self.stream.buffer_pool
        if pool is not None and self.persistent_workers and self._iterator is not None:
            pool.free_unreceived()
            return pool
        self.stream.buffer_pool = BatchBufferPool(self.num_workers, self.prefetch_factor + BATCHES_HELD_BY_TRAINING)
        return self.stream.buffer_pool

    def state_dict(self) -> dict[str, Any]:
        # Positions are stored in global batches (all ranks), so a run can resume on another number of ranks.
        return {
            "epoch": self.epoch,
            "global_batches": self.batches * self.stream.world_size,
            "bad_samples": self.bad_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world = self.stream.world_size
        global_batches = int(state["global_batches"])
        local = -(-global_batches // world)  # round up: never repeat a batch
        if local * world != global_batches:
            logger.warning(
                "resuming at global batch %d on %d ranks: skipping %d batch(es) to reach a multiple of the rank count",
                global_batches,
                world,
                local * world - global_batches,
            )
        self.epoch, self.batches = int(state["epoch"]), local
        if self.batches >= len(self):
            self.epoch, self.batches = self.epoch + 1, 0
        self.bad_samples = int(state.get("bad_samples", 0))
        logger.info("data loader resumes at epoch %d, batch %d", self.epoch, self.batches)

    def _count_bad(self, errors: Sequence[str]) -> None:
        for error in errors:
            self.bad_samples += 1
            if self.bad_samples <= LOGGED_BAD_SAMPLES or self.bad_samples % 100 == 0:
                logger.warning("skipped bad sample (%d so far): %s", self.bad_samples, error)


# How long a worker whose connection broke may take to finish dying, before its exit status is read.
_DYING_WORKER_S = 2.0


def _killed_worker(err: Exception, workers: list) -> RuntimeError | None:
    """The signal that killed a loader worker, said as torch says it when its signal handler sees the
    death first. torch has two other ways: a worker that died between two of its looks "exited
    unexpectedly", and a batch it had queued, whose tensors it shares by file descriptor, fails to
    arrive with a broken connection. None when ``err`` is none of these, or no worker died of a signal."""
    if isinstance(err, (ConnectionError, EOFError)):
        deadline = time.monotonic() + _DYING_WORKER_S  # the peer that vanished may still be dying
        while time.monotonic() < deadline and not any((worker.exitcode or 0) < 0 for worker in workers):
            time.sleep(0.02)
    elif not (isinstance(err, RuntimeError) and "exited unexpectedly" in str(err)):
        return None
    killed = [(worker.pid, worker.exitcode) for worker in workers if (worker.exitcode or 0) < 0]
    if not killed:
        return None
    pid, exitcode = killed[0]
    return RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: {signal.strsignal(-exitcode)}.")


def _lending(batches: Iterator[dict[str, Any]], pool: BatchBufferPool) -> Iterator[dict[str, Any]]:
    """The batches, each pooled image buffer watched until training lets go of it. Watched before the
    device prefetcher's copy; with ``pin_memory`` the watch is on PyTorch's pinned copy, which
    outlives the buffer's use, so a slot may come back late, never early."""
    for batch in batches:
        pool.collect()
        slot = batch.pop(BUFFER_KEY, None)
        if slot is not None:
            pool.lend(slot, batch["images"])
        yield batch


def _layout(source: FrameDataset) -> SourceLayout:
    position = {episode: k for k, episode in enumerate(source.episodes)}
    shards = [tuple(position[e] for e in shard if e in position) for shard in source.metadata.shards()]
    return SourceLayout(tuple(int(n) for n in source.lengths), tuple(shard for shard in shards if shard))
