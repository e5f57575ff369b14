"""The device mesh every uma strategy trains on: pp x dp_replicate x dp_shard x tp, with ep inside dp.

- ``pp``: pipeline stages, each holding a contiguous part of the model's layers (``plans/pipeline.py``);
- ``dp_replicate``: data-parallel groups that hold full replicas (DDP, or the replicate half of HSDP);
- ``dp_shard``: data-parallel ranks that shard parameters, gradients and optimizer state (FSDP);
- ``tp``: ranks that split each layer's matrices (tensor parallel), all seeing the same batch;
- ``ep``: ranks that split the experts of every mixture-of-experts layer between them and send
  each token to the rank owning its expert (all-to-all). They are data-parallel ranks, each with
  its own samples, so ep adds no processes: it divides the data-parallel dimension the dense
  layers use, and the experts are laid out on what is left of it.

Ranks are laid out row-major, so tp is innermost: the ranks of a tensor-parallel group are
neighbours, which on a GPU node keeps its frequent collectives on the fastest links. pp is
outermost: stages exchange only activations, the least traffic, so they may span nodes. ep takes the
innermost ranks of the data-parallel dimension that is larger than one, for the same reason as tp
(the all-to-all is the most frequent exchange after tp's):

- dense layers sharded (FSDP, dp_shard > 1): dp_shard = expert_shard x ep. The experts of one ep
  rank are FSDP-sharded over the expert_shard ranks that hold the same experts;
- dense layers replicated (DDP, dp_shard = 1): dp_replicate = expert_replicate x ep. The experts
  of one ep rank are replicated over the expert_replicate ranks, gradients all-reduced.

The mesh is built with those finer dimensions and dp_shard (or dp_replicate) flattened from them,
so every dimension is a sub-mesh of one root mesh, which FSDP needs to combine the experts' ep
layout with their data-parallel sharding. ep inside HSDP (both data-parallel sizes above one) is
refused, as are ep with tp (``plans/robot.py``: experts split over ep or computed whole on each tp rank) and ep
with pp (evaluation would desynchronise the experts' all-to-alls: MoE models train under pp without ep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# A mesh size in config: a number, "auto" (whatever the other sizes leave of the world), or
# "node" (the processes of one node, e.g. shard within a node and replicate across nodes).
# For ep, "auto" is every data-parallel rank.
MeshSize = Union[int, Literal["auto", "node"]]


@dataclass(frozen=True)
class MeshSizes:
    """The mesh a strategy asks for; each size a number, "auto" (what the other sizes leave) or "node"
    (the processes of one node). The defaults shard over every process (FSDP).

    Args:
        dp_replicate: Data-parallel replica groups (DDP, or the replicate half of HSDP).
        dp_shard: Ranks that shard parameters, gradients and optimizer state within a replica group.
        tp: Tensor-parallel ranks, which split every layer and see the same batch.
        pp: Pipeline stages (ranks), each holding a contiguous part of the layers and seeing the same batch.
        ep: Expert-parallel ranks, which split every mixture-of-experts layer's experts: data-parallel
            ranks ("auto": all of them).
    """

    dp_replicate: MeshSize = 1
    dp_shard: MeshSize = "auto"
    tp: MeshSize = 1
    pp: MeshSize = 1
    ep: MeshSize = 1


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1  # after the three above, so a shape without pipeline stages reads (dp_replicate, dp_shard, tp)
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: each of an ep rank's experts is sharded (FSDP) or replicated (DDP) over them."""
        return self.dp // self.ep

    def __str__(self) -> str:
        stages = f"pp {self.pp} x " if self.pp > 1 else ""
        experts = (
            f" (ep {self.ep}: experts split over {self.ep} ranks, held by {self.expert_dp})" if self.ep > 1 else ""
        )
        return f"{stages}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp}{experts}"


def resolve_mesh_shape(sizes: dict[str, MeshSize], world_size: int, processes_per_node: int) -> MeshShape:
    """Concrete sizes for ``sizes`` (keyed by MESH_DIMS, and optionally ep; a missing pp is 1) on
    ``world_size`` processes, or a one-line ValueError."""
    sizes = {"pp": 1, **sizes}
    resolved: dict[str, int] = {}
    auto = [name for name in MESH_DIMS if sizes[name] == "auto"]
    if len(auto) > 1:
        raise ValueError(
            f"mesh: at most one of pp, dp_replicate, dp_shard, tp may be 'auto', got {describe_sizes(sizes)}"
        )
    for name in MESH_DIMS:
        value = _size(name, sizes[name], processes_per_node)
        if value != "auto":
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
    ep = _size("ep", sizes.get("ep", 1), processes_per_node)
    return MeshShape(**resolved, ep=_check_ep(shape, shape.dp if ep == "auto" else ep))


def _size(name: str, value: MeshSize, processes_per_node: int) -> int | str:
    if value == "node":
        return processes_per_node
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mesh: {name} must be a positive integer, 'auto' or 'node', got {value!r}")
    return value


def _check_ep(shape: MeshShape, ep: int) -> int:
    if ep == 1:
        return ep
    if shape.pp > 1:
        # Training runs (uma parity matches one process), but evaluation does not: the ep ranks of a
        # stage get batches of different sizes, which the schedule cuts into different numbers of
        # microbatches, while each MoE layer's all-to-all needs every one of those ranks.
        raise ValueError(
            f"mesh {shape}: ep {ep} with pipeline stages is not supported yet (evaluation batches of different sizes on the ranks that split a stage's experts "
            "would run different numbers of all-to-alls); MoE models train under pp and pp_fsdp without ep (each stage's experts whole, FSDP-sharded under pp_fsdp), "
            "or under ep and ep_fsdp without pp"
        )
    if shape.dp_replicate > 1 and shape.dp_shard > 1:
        raise ValueError(
            f"mesh {shape}: ep {ep} inside HSDP (dp_replicate and dp_shard both above 1) is not supported; use dp_replicate 1 (ep_fsdp) or dp_shard 1 (ep)"
        )
    data = "dp_shard" if shape.dp_shard > 1 else "dp_replicate"
    if getattr(shape, data) % ep:
        raise ValueError(
            f"mesh {shape}: ep {ep} does not divide the {getattr(shape, data)} data-parallel ranks ({data}) it splits the experts over"
        )
    return ep


def build_mesh(shape: MeshShape, device_type: str):
    """The root mesh, with dims pp, dp_replicate, dp_shard and tp; with ep > 1 also ep and
    expert_shard (FSDP) or expert_replicate (DDP), the dimension ep was carved out of being
    flattened from them (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape.ep == 1:
        return init_device_mesh(
            device_type, (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp), mesh_dim_names=MESH_DIMS
        )
    if shape.dp_shard > 1:
        dims = {
            "pp": shape.pp,
            "dp_replicate": shape.dp_replicate,
            "expert_shard": shape.expert_dp,
            "ep": shape.ep,
            "tp": shape.tp,
        }
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        mesh["expert_shard", "ep"]._flatten("dp_shard")
    else:
        dims = {
            "pp": shape.pp,
            "expert_replicate": shape.expert_dp,
            "ep": shape.ep,
            "dp_shard": shape.dp_shard,
            "tp": shape.tp,
        }
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        mesh["expert_replicate", "ep"]._flatten("dp_replicate")
    return mesh


def describe_sizes(sizes: dict[str, MeshSize]) -> str:
    """The sizes asked, pp left out where it is 1 (no pipeline), ep added where it is not."""
    asked = " x ".join(f"{name} {sizes.get(name, 1)}" for name in MESH_DIMS if name != "pp" or sizes.get("pp", 1) != 1)
    return asked + (f", ep {sizes['ep']}" if sizes.get("ep", 1) != 1 else "")
