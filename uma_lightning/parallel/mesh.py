"""The device mesh every uma strategy trains on: pp x dp_replicate x dp_shard x tp.

- ``pp``: pipeline stages, each holding a contiguous part of the model's layers (``plans/pipeline.py``);
- ``dp_replicate``: data-parallel groups that hold full replicas (DDP, or the replicate half of HSDP);
- ``dp_shard``: data-parallel ranks that shard parameters, gradients and optimizer state (FSDP);
- ``tp``: ranks that split each layer's matrices (tensor parallel), all seeing the same batch.

Ranks are laid out row-major, so tp is innermost: the ranks of a tensor-parallel group are
neighbours, which on a GPU node keeps its frequent collectives on the fastest links. pp is
outermost: stages exchange only activations, the least traffic, so they may span nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# A mesh size in config: a number, "auto" (whatever the other sizes leave of the world), or
# "node" (the processes of one node, e.g. shard within a node and replicate across nodes).
MeshSize = Union[int, Literal["auto", "node"]]


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1  # last, so a shape without pipeline stages reads (dp_replicate, dp_shard, tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        stages = f"pp {self.pp} x " if self.pp > 1 else ""
        return f"{stages}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp}"


def resolve_mesh_shape(sizes: dict[str, MeshSize], world_size: int, processes_per_node: int) -> MeshShape:
    """Concrete sizes for ``sizes`` (keyed by MESH_DIMS; a missing pp is 1) on ``world_size`` processes, or a one-line ValueError."""
    sizes = {"pp": 1, **sizes}
    resolved: dict[str, int] = {}
    auto = [name for name in MESH_DIMS if sizes[name] == "auto"]
    if len(auto) > 1:
        raise ValueError(f"mesh: at most one of pp, dp_replicate, dp_shard, tp may be 'auto', got {describe_sizes(sizes)}")
    for name in MESH_DIMS:
        value = sizes[name]
        if value == "node":
            value = processes_per_node
        if value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh: {name} must be a positive integer, 'auto' or 'node', got {value!r}")
        resolved[name] = value
    fixed = math.prod(resolved.values())
    if auto:
        if world_size % fixed:
            raise ValueError(
                f"mesh {describe_sizes(sizes)}: {world_size} processes do not divide by {fixed}, so {auto[0]} 'auto' has no size"
            )
        resolved[auto[0]] = world_size // fixed
    shape = MeshShape(**resolved)
    if shape.world_size != world_size:
        raise ValueError(
            f"mesh {shape} needs {shape.world_size} processes, but the world size is {world_size} "
            f"({world_size // processes_per_node} node(s) x {processes_per_node} process(es))"
        )
    return shape


def build_mesh(shape: MeshShape, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp), mesh_dim_names=MESH_DIMS)


def describe_sizes(sizes: dict[str, MeshSize]) -> str:
    """The sizes asked, pp left out where it is 1 (no pipeline)."""
    return " x ".join(f"{name} {sizes.get(name, 1)}" for name in MESH_DIMS if name != "pp" or sizes.get("pp", 1) != 1)


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
