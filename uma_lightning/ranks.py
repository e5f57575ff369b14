"""Which data-parallel rank a process is, from the trainer's strategy: for the data, the callbacks and the
checkpoints, which must not import the parallel layer (its strategy) to ask."""

from __future__ import annotations


def data_parallel_rank(trainer) -> tuple[int, int]:
    """(rank, size) among the processes that see different samples. Read from the strategy's
    ``distributed_sampler_kwargs`` (Lightning's convention), so tensor-parallel ranks, which share
    their batch, count once; a trainer-less or single-process run is (0, 1)."""
    if trainer is None:
        return 0, 1
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return sampler.get("rank", trainer.global_rank), sampler.get("num_replicas", trainer.world_size)


def random_stream_rank(trainer) -> int:
    """The rank whose random stream this process draws: the first of its tensor-parallel group. The
    ranks that split one batch must draw the same noise for it (flow-matching noise and times, ...),
    as they were one process; data-parallel ranks draw their own."""
    rank, size = data_parallel_rank(trainer)
    return rank * ((trainer.world_size if trainer is not None else 1) // size)
