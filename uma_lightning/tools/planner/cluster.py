"""The cluster a plan is for: the accelerator (memory, peak FLOP/s) and the links between ranks.

Peak FLOP/s come from the MFU callback's table (``callbacks/peak_flops.py``); this module adds only
what that table lacks: memory, the NVLink speed of each part, and link presets.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# What one node's checkpoint storage writes, GB/s: a local NVMe drive or the node's share of a parallel
# file system. Nodes write their own ranks' shards at the same time.
DISK_GB_S = 2.0


@dataclass(frozen=True)
class Accelerator:
    name: str  # the key in PEAK_TFLOPS, or "CPU"
    memory_gib: float  # what the device reports as total (torch.cuda.mem_get_info), not the marketing GB
    nvlink_gb_s: float  # NVLink bandwidth per GPU and direction; 0 without NVLink


ACCELERATORS = {
    "h100": Accelerator("H100", 79.2, 450.0),  # SXM 80 GB, NVLink 4
    "h200": Accelerator("H200", 139.8, 450.0),  # SXM 141 GB, NVLink 4
    "b200": Accelerator("B200", 178.4, 900.0),  # 192 GB HBM3e, NVLink 5
    "a100": Accelerator("A100", 79.2, 300.0),  # SXM 80 GB, NVLink 3
    "cpu": Accelerator("CPU", 0.0, 0.0),  # memory: --gpu-memory-gib or the host's, split over its processes
}


@dataclass(frozen=True)
class Link:
    gb_s: float  # bandwidth per rank and direction, GB/s (1e9 bytes)
    latency_us: float  # per message hop (the alpha of the alpha-beta model)


# Per rank (one NIC per GPU on the networks), per direction. Effective figures, below line rate:
# NCCL's bus bandwidth on these reaches about 80-90 % of it.
LINK_PRESETS = {
    "nvlink": None,  # the accelerator's own NVLink bandwidth
    "ib-ndr": Link(45.0, 5.0),  # InfiniBand NDR, 400 Gb/s
    "roce": Link(40.0, 8.0),  # RoCE v2, 400 Gb/s Ethernet
    "pcie": Link(22.0, 10.0),  # PCIe Gen4 x16 through the host
    "loopback": Link(5.0, 30.0),  # gloo between CPU processes on one machine
}
NVLINK_LATENCY_US = 3.0


def preset_link(name: str, accelerator: Accelerator) -> Link:
    if name not in LINK_PRESETS:
        raise ValueError(f"unknown link preset {name!r} (choose from {', '.join(LINK_PRESETS)})")
    if name == "nvlink":
        if not accelerator.nvlink_gb_s:
            raise ValueError(f"{accelerator.name} has no NVLink; choose pcie or loopback")
        return Link(accelerator.nvlink_gb_s, NVLINK_LATENCY_US)
    return LINK_PRESETS[name]


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    accelerator: Accelerator
    memory_gib: float  # usable per rank
    peak_tflops: float  # dense, per rank, for the run's matmul dtype
    intra: Link
    inter: Link
    disk_gb_s: float = DISK_GB_S  # checkpoint writes per node

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} {self.accelerator.name} ({self.memory_gib:.1f} GiB, "
            f"{self.peak_tflops:.4g} TFLOP/s peak each); links {self.intra.gb_s:g} GB/s in a node, {self.inter.gb_s:g} GB/s across; "
            f"checkpoints written at {self.disk_gb_s:g} GB/s per node"
        )
