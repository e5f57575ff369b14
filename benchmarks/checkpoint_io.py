"""Checkpoint I/O of the `small` model (about 100 M parameters, with AdamW state), on the CPU or a GPU.

Measured side by side in one run, alternating, medians over the repeats:

- how long training is blocked by an asynchronous save: the time spent in ``save()`` plus in
  ``wait_staged()`` before the next optimizer step, once right after the save (no overlap) and once
  after a real forward and backward pass (the copy to host memory overlaps it, as in training),
  after one untimed save that allocates the host-memory copy later saves reuse;
- every save follows a training step (forward, backward, optimizer step), as saves do in training:
  on an idle machine the first large copy after a pause runs about 40% slower than on busy cores;
- against how long a synchronous save blocks (write, fsync, checksums, manifest, commit);
- save throughput against the disk's raw sequential write speed: the same number of bytes in 64 MiB
  blocks and an fsync, once through the page cache and once with O_DIRECT, the faster of the two
  being the limit (saves write with O_DIRECT where the file system allows), in alternating order;
- a cold load (every file of the checkpoint dropped from the page cache first) against a cold raw
  sequential read (64 MiB blocks) of another checkpoint of the same tensors, each checkpoint read once:
  a virtual disk's host serves a second read of the same bytes from its own cache;
- where a save's time goes, phase by phase, from the writers' own timers (``last_profile``).

    python benchmarks/checkpoint_io.py [--repeats 3] [--dir /tmp/checkpoint_io] [--json ratios.json]
    python benchmarks/checkpoint_io.py --device cuda    # on the GPU machine: copies from the device to pinned memory

On a GPU the cold load is also measured through DCP's own path (``torch.load`` of each entry on the
host, then a copy to the device), against the loader's reads through pinned buffers.
    python benchmarks/checkpoint_io.py --size tiny --repeats 1    # the smoke run the test suite makes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median, print_table  # noqa: E402

from uma_lightning.checkpoint import CheckpointWriter, step_dirname, storage  # noqa: E402
from uma_lightning.checkpoint.state import encode_parts, load_module, model_and_optimizer  # noqa: E402
from uma_lightning.data.spec import DataSpec  # noqa: E402
from uma_lightning.modules import NetworkConfig, PretrainModule  # noqa: E402

# The embedded planar-arm data's shapes.
SPEC = DataSpec(
    cameras=("observation.images.top",),
    image_size=(64, 64),
    state_dim=5,
    action_dim=3,
    n_obs_steps=1,
    action_horizon=8,
    fps=10.0,
)


def small_model(size: str = "small", device: str = "cpu") -> tuple[PretrainModule, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    module = PretrainModule(spec=SPEC, network=NetworkConfig(size=size))
    module.configure_model()
    module.to(device)
    optimizer = module.build_optimizer([p for p in module.parameters() if p.requires_grad])
    batch = {
        "images": torch.randint(0, 256, (1, 1, 1, 64, 64, 3), dtype=torch.uint8, device=device),
        "state": torch.randn(1, 1, SPEC.state_dim, device=device),
        "actions": torch.rand(1, SPEC.action_horizon, SPEC.action_dim, device=device) * 2 - 1,
        "action_mask": torch.ones(1, SPEC.action_horizon, dtype=torch.bool, device=device),
        "instruction": ["reach the red square"],
    }
    forward_backward(module, batch)
    optimizer.step()  # creates the AdamW state that checkpoints carry
    optimizer.zero_grad()
    return module, optimizer, batch


def forward_backward(module: PretrainModule, batch: dict) -> None:
    module.compute_loss(batch)["loss"].backward()
    synchronize(batch)


def synchronize(batch: dict) -> None:
    """Wait for the GPU's queued work, so that it is timed where it is queued."""
    if batch["state"].is_cuda:
        torch.cuda.synchronize()


def train_step(module: PretrainModule, optimizer: torch.optim.Optimizer, batch: dict) -> None:
    forward_backward(module, batch)
    optimizer.step()
    optimizer.zero_grad()
    synchronize(batch)


BLOCK = 64 * 2**20


def raw_write(path: Path, nbytes: int, direct: bool = False) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them, through the page cache or with O_DIRECT."""
    block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT asks
    block.write(np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        for offset in range(0, nbytes, BLOCK):
            length = min(BLOCK, nbytes - offset)
            os.write(fd, memoryview(block)[: -(-length // 4096) * 4096 if direct else length])
        os.fsync(fd)
    finally:
        os.close(fd)
    written = time.perf_counter() - started
    path.unlink()
    return written


def raw_cold_read(directory: Path) -> float:
    """Seconds to read every file of ``directory`` sequentially, from the disk."""
    drop_from_page_cache(directory)
    buffer = bytearray(BLOCK)
    started = time.perf_counter()
    for path in sorted(directory.iterdir()):
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    return time.perf_counter() - started


def drop_from_page_cache(path: Path) -> None:
    """Evict the file's (clean, fsynced) pages, so that the next read comes from the disk."""
    for file_path in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        fd = os.open(file_path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the four ratios to this JSON file")
    parser.add_argument("--size", default="small", help="model size (configs/model); default small")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    root = Path(tempfile.mkdtemp(prefix="checkpoint_io_", dir=args.dir))
    try:
        ratios = run(root, args.repeats, args.size, args.device)
        if args.json is not None:
            args.json.write_text(json.dumps(ratios, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, repeats: int, size: str = "small", device: str = "cpu") -> dict[str, float]:
    module, optimizer, batch = small_model(size, device)
    state, tensors = encode_parts(model_and_optimizer(module, [optimizer]))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    n_parameters = sum(p.numel() for p in module.parameters())
    print(
        f"{size} model on {device}: {n_parameters / 1e6:.1f} M parameters, {nbytes / 1e9:.2f} GB of model and "
        f"optimizer state; {torch.get_num_threads()} threads, writing to {root}"
    )
    sync_writer = CheckpointWriter(root / "sync", 1, None, async_save=False, process_group=None)
    async_writer = CheckpointWriter(root / "async", 2, None, async_save=True, process_group=None)
    summary = {"epoch": 0, "world_size": 1}
    times: dict[str, list[float]] = {
        name: []
        for name in (
            "raw write",
            "raw write, O_DIRECT",
            "raw cold read",
            "sync save",
            "async blocked, no overlap",
            "async blocked, overlapping",
            "async until committed",
            "forward+backward",
            "forward+backward with staging",
            "cold load",
            *(["cold load, DCP's path"] if device == "cuda" else []),
        )
    }
    profiles: dict[str, list[dict[str, float]]] = {"sync save": [], "async save": []}
    # Warm-up, untimed: the first async save allocates the host-memory copy that later saves reuse.
    async_writer.save(0, state, tensors, summary)
    async_writer.wait()
    step = 0
    for repeat in range(repeats):
        # Alternating which goes first: the disk is shared, and a write can slow the one after it.
        for measure in ("raw write", "raw write, O_DIRECT", "sync save")[:: 1 if repeat % 2 else -1]:
            if measure.startswith("raw write"):
                times[measure].append(raw_write(root / "raw.bin", nbytes, direct=measure.endswith("O_DIRECT")))
                continue
            train_step(module, optimizer, batch)
            step += 1
            started = time.perf_counter()
            sync_writer.save(step, state, tensors, summary)
            times["sync save"].append(time.perf_counter() - started)
            profiles["sync save"].append(sync_writer.last_profile)
            sync_writer.wait_pruned()  # the older checkpoint's deletion, in the background, overlaps nothing timed

        train_step(module, optimizer, batch)
        step += 1
        started = time.perf_counter()
        async_writer.save(step, state, tensors, summary)
        async_writer.wait_staged()
        times["async blocked, no overlap"].append(time.perf_counter() - started)
        async_writer.wait()
        times["async until committed"].append(time.perf_counter() - started)
        profiles["async save"].append(async_writer.last_profile)
        async_writer.wait_pruned()

        started = time.perf_counter()
        forward_backward(module, batch)
        times["forward+backward"].append(time.perf_counter() - started)
        optimizer.zero_grad()

        step += 1
        started = time.perf_counter()
        async_writer.save(step, state, tensors, summary)
        blocked = time.perf_counter() - started
        computed = time.perf_counter()
        forward_backward(module, batch)
        times["forward+backward with staging"].append(time.perf_counter() - computed)
        waited = time.perf_counter()
        async_writer.wait_staged()  # where training waits: just before the optimizer step
        times["async blocked, overlapping"].append(blocked + time.perf_counter() - waited)
        optimizer.zero_grad()
        async_writer.wait()
        async_writer.wait_pruned()

        # Each read is of a checkpoint nothing has read yet (all three hold the same tensors, so the same
        # bytes in number and layout): a second read of the same bytes came from a cache below ours (the
        # virtual disk's host) with the page cache dropped, whichever read was second ran 2 to 3x faster.
        unread = [root / "sync" / step_dirname(step - 2), *(root / "async" / step_dirname(s) for s in (step - 1, step))]
        loads = [name for name in times if name.startswith(("raw cold read", "cold load"))]
        for index, measure in enumerate(loads[:: 1 if repeat % 2 else -1]):
            checkpoint = unread[(index + repeat) % len(unread)]
            if measure == "raw cold read":
                times[measure].append(raw_cold_read(checkpoint))
                continue
            drop_from_page_cache(checkpoint)
            with dcp_path_only() if measure == "cold load, DCP's path" else contextlib.nullcontext():
                started = time.perf_counter()
                load_module(module, checkpoint, [optimizer])
                if device == "cuda":
                    torch.cuda.synchronize()
                times[measure].append(time.perf_counter() - started)
        print(
            f"repeat {repeat + 1}/{repeats}: "
            + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in times.items()),
            flush=True,
        )
    sync_writer.close()
    async_writer.close()

    med = {name: median(values) for name, values in times.items()}
    # The disk's write speed is the faster of its two raw writes: saves are held to the better one.
    med["raw write, faster"] = min(med["raw write"], med["raw write, O_DIRECT"])
    gb = nbytes / 1e9
    limits = {"sync save": "raw write, faster", "async until committed": "raw write, faster"}
    limits.update({name: "raw cold read" for name in times if name.startswith("cold load")})
    print_table(
        f"checkpoint I/O, medians of {repeats}",
        ["measurement", "seconds", "GB/s", "vs sync save", "vs its raw limit"],
        [
            [
                name,
                med[name],
                gb / med[name] if name.startswith("raw") or name in limits else "",
                med[name] / med["sync save"],
                f"{med[limits[name]] / med[name]:.2f}x {limits[name]}" if name in limits else "",
            ]
            for name in times
        ],
    )
    print_profile(profiles, med)
    extra = med["forward+backward with staging"] - med["forward+backward"] + med["async blocked, overlapping"]
    print(
        f"\ntraining blocked by an async save: {med['async blocked, no overlap'] / med['sync save']:.1%} of a synchronous save "
        f"when the optimizer step follows at once, {med['async blocked, overlapping'] / med['sync save']:.1%} when the copy "
        f"overlaps a forward and backward pass (goal <= 5%). That pass took {med['forward+backward with staging'] / med['forward+backward']:.2f}x "
        f"as long, because the background copy and write share these {torch.get_num_threads()} cores: {extra / med['sync save']:.1%} "
        f"of a synchronous save in all"
    )
    ratios = {
        "sync_save_vs_raw_write": med["raw write, faster"] / med["sync save"],
        "async_commit_vs_raw_write": med["raw write, faster"] / med["async until committed"],
        "cold_load_vs_raw_read": med["raw cold read"] / med["cold load"],
        "async_blocked_vs_sync_save": med["async blocked, no overlap"] / med["sync save"],
    }
    print("ratios (goals: >= 0.8, >= 0.8, >= 0.8, <= 0.05): " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


@contextlib.contextmanager
def dcp_path_only():
    """Loads read host tensors only in place: a GPU's go through DCP, as before the pinned buffers."""
    readable = storage._READABLE
    storage._READABLE = ("cpu",)
    try:
        yield
    finally:
        storage._READABLE = readable


def print_profile(profiles: dict[str, list[dict[str, float]]], med: dict[str, float]) -> None:
    """Median seconds per phase of each kind of save. Serialisation is what the tensor writing took
    beyond its writes, checksums and fsyncs (torch.save's zip records, DCP's planning)."""
    rows = []
    for kind, runs in profiles.items():
        phases = {}
        for run_phases in runs:
            run_phases = dict(run_phases)
            tensors = run_phases.pop("tensors in all", 0.0)
            run_phases["serialisation"] = tensors - sum(run_phases.get(p, 0.0) for p in ("write", "checksum", "fsync"))
            for phase, seconds in run_phases.items():
                phases.setdefault(phase, []).append(seconds)
        total = med["sync save" if kind == "sync save" else "async until committed"]
        rows += [[kind, phase, median(values), f"{median(values) / total:.1%}"] for phase, values in phases.items()]
    print_table(
        "where a save's time goes (medians, from the writers' timers)",
        ["save", "phase", "seconds", "of the save"],
        rows,
    )


if __name__ == "__main__":
    main()
