"""Peak dense matrix-multiply throughput per device and dtype: the denominator of MFU.

Figures are the vendors' dense (no 2:4 sparsity) tensor-core numbers in TFLOP/s per device. A device
missing from the table, or a CPU, is measured instead with a short matmul probe, unless the config
gives the peak outright. A probe runs once per host, device, dtype, thread count and torch version;
later runs read its figure from the cache (``peak_tflops.json``; delete it to measure again), so every
run and every resume of a run on one machine divides by the same peak, and no run waits for the probe.
A run that achieves more than the cached figure raises it (``keep_achieved_rate``): the peak of a host
is never below a rate achieved on it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import socket
import time
from pathlib import Path

import torch

from uma_lightning.cache_dir import default_cache_dir

log = logging.getLogger(__name__)

PROBE_CACHE = "peak_tflops.json"

# Most specific names first: "H100 NVL" must match before "H100", "GH200" before "H200", "L40S" before "L4".
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "GB200": {"fp8": 5000, "bf16": 2500, "fp16": 2500, "tf32": 1250, "fp32": 90},
    "B200": {"fp8": 4500, "bf16": 2250, "fp16": 2250, "tf32": 1125, "fp32": 75},
    "GH200": {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},
    "H200 NVL": {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60},
    "H200": {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},
    "H100 NVL": {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60},
    "H100 PCIe": {"fp8": 1513, "bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51},
    "H100": {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},  # SXM, named "H100 80GB HBM3"
    "H800": {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},
    "A100": {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},  # SXM and PCIe alike
    "A800": {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
    "L40S": {"fp8": 733, "bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6},
    "L4": {"fp8": 242.5, "bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3},
    "MI325X": {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI300X": {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


def table_entry(device_name: str) -> str | None:
    """The table key for a device name as CUDA reports it ("NVIDIA H100 80GB HBM3" -> "H100")."""
    normalised = device_name.replace("-", " ").upper()
    for key in PEAK_TFLOPS:
        if key.upper() in normalised:
            return key
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype most training matmuls run in under a Lightning precision setting."""
    precision = str(precision)
    if precision.startswith("transformer-engine"):
        return "fp8"
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    # fp32 matmuls run on tensor cores as tf32 unless PyTorch is told to keep full precision.
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# Square sizes the probe tries, each for a share of its time. On a CPU that other work shares, small
# products reach the higher rate: one call fits in an uninterrupted slice of the cores, where a
# 1024-square call on two busy cores measured a fifth of a 512-square one's rate.
PROBE_SIZES = (256, 512, 1024)


def probe_tflops(device: torch.device, dtype: str = "fp32", sizes=PROBE_SIZES, seconds: float = 0.45) -> float:
    """Best observed TFLOP/s of square matmuls of ``sizes`` in ``dtype`` on ``device``, with every
    thread torch uses, measured for about ``seconds`` in all."""
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
        dtype, torch.float64 if dtype == "fp64" else torch.float32
    )
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=torch_dtype)
        b = torch.randn(size, size, device=device, dtype=torch_dtype)
        torch.mm(a, b)  # warm-up: library initialisation and kernel selection
        fastest = float("inf")
        deadline = time.perf_counter() + seconds / len(sizes)
        while True:
            start = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            fastest = min(fastest, time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
        best = max(best, 2 * size**3 / fastest / 1e12)
    return best


def resolve_peak(device: torch.device, precision: str, override_tflops: float | None = None) -> tuple[float, str]:
    """Peak TFLOP/s of one device for this precision, and where the figure comes from."""
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0, got {override_tflops}")
        return float(override_tflops), "config"
    dtype = matmul_dtype(precision)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = table_entry(name)
        if key is not None and dtype in PEAK_TFLOPS[key]:
            return PEAK_TFLOPS[key][dtype], f"table: {key} {dtype} dense"
        why = f"{name} is not in the table" if key is None else f"the table has no {dtype} figure for {key}"
        peak, when = probed_peak(device, name, dtype)
        return peak, f"matmul probe {when}, because {why}; set peak_tflops to use the datasheet figure"
    peak, when = probed_peak(device, _cpu_name(), dtype)
    return peak, f"matmul probe on {device.type} ({dtype}) {when}; set peak_tflops to override"


def probed_peak(device: torch.device, device_name: str, dtype: str) -> tuple[float, str]:
    """The probe's TFLOP/s for this host, device, dtype and thread count, measured now or read from
    the cache; and which of the two, for the log."""
    path, key = default_cache_dir() / PROBE_CACHE, _probe_key(device_name, dtype)
    known = _read_probes(path)
    if key in known:
        return known[key], f"measured earlier on this host ({path})"
    return _keep_best(path, key, probe_tflops(device, dtype)), f"measured now, kept in {path}"


def keep_achieved_rate(device: torch.device, precision: str, tflops: float) -> float:
    """Raise this host's probed peak for the device and precision to a rate a run achieved, so no
    later run divides by less; returns the figure kept (the higher of the two)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return _keep_best(default_cache_dir() / PROBE_CACHE, _probe_key(name, matmul_dtype(precision)), tflops)


def _probe_key(device_name: str, dtype: str) -> str:
    return " | ".join(
        (socket.gethostname(), device_name, dtype, f"{torch.get_num_threads()} threads", f"torch {torch.__version__}")
    )


def _keep_best(path: Path, key: str, tflops: float) -> float:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of a job probe at the same moment
        known = _read_probes(path)
        known[key] = max(known.get(key, 0.0), tflops)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(staging, path)
    return known[key]


def _read_probes(path: Path) -> dict[str, float]:
    try:
        known = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring the unreadable peak cache %s (%s); measuring again", path, err)
        return {}
    if not isinstance(known, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in known.values()):
        log.warning("ignoring the peak cache %s: not a mapping to positive TFLOP/s; measuring again", path)
        return {}
    return known


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
