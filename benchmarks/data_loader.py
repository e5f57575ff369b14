"""Data loader throughput against the raw decoder, per worker count, and the data-wait share of a training step.

1. Decoded frames/s of the training loader (RobotDataModule: shuffled order, random access into the
   videos, normalisation, collation) for each worker count, against PyAV decoding the very same
   frames in one process in the cheapest order: file by file, each file's frames in time order
   (no seeking back). Steady state: the clock starts at the first batch, after worker start-up.
   Rounds alternate the variants; medians and ratios are printed.
2. The fraction of step time spent waiting for data in the default pretrain recipe
   (`uma fit --config recipes/pretrain.yaml`, as measured by its StepTimeBreakdown callback).

    python benchmarks/data_loader.py [--batches 60] [--workers 0 1 2] [--rounds 2] [--recipe-steps 300]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harness import median, print_table
from uma_lightning.data import RobotDataModule, VideoReader
from uma_lightning.data.order import EpochOrder

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "pretrain.yaml")


def frames_of_first_batches(dm: RobotDataModule, n_batches: int) -> list[tuple[Path, float]]:
    """(video file, time) of every frame the first `n_batches` training batches hold."""
    loader = dm.train_dataloader()
    order = EpochOrder(loader.stream.layouts, dm.order, epoch=0)
    frames = []
    for b in range(n_batches):
        datasets, rows = order.batch(b)
        for d, row in zip(datasets.tolist(), rows.tolist()):
            source = dm.train_sets[d]
            episode, t = source.locate(row)
            timestamps = source.metadata.read_episode(episode).timestamp.astype(np.float64)
            for offset in source.obs_offsets:
                step = int(np.clip(t + offset, 0, len(timestamps) - 1))
                for camera in source.metadata.cameras:
                    start = source.metadata.episodes[episode].videos[camera][1]
                    frames.append((source.metadata.video_path(episode, camera), start + timestamps[step]))
    return frames


def raw_decode_seconds(frames: list[tuple[Path, float]]) -> float:
    by_file: dict[Path, list[float]] = {}
    for path, time_s in frames:
        by_file.setdefault(path, []).append(time_s)
    start = time.perf_counter()
    for path, times in sorted(by_file.items()):
        reader = VideoReader(path)
        reader.frames_at(np.sort(np.asarray(times)), tolerance_s=1e-4)
        reader.close()
    return time.perf_counter() - start


def loader_seconds(dm: RobotDataModule, n_batches: int) -> float:
    """Seconds for batches 2..n (the first batch pays for worker start-up)."""
    iterator = iter(dm.train_dataloader())
    next(iterator)
    start = time.perf_counter()
    for _ in range(n_batches - 1):
        next(iterator)
    return time.perf_counter() - start


def recipe_wait_fraction(steps: int) -> tuple[float, float, float]:
    """Run the recipe as `uma fit` does, in a fresh process (its own thread settings), and read the
    totals of its StepTimeBreakdown."""
    script = (
        "import sys, tempfile\n"
        "from uma_lightning.callbacks import StepTimeBreakdown\n"
        "from uma_lightning.cli import UmaCLI\n"
        "with tempfile.TemporaryDirectory() as workdir:\n"
        "    cli = UmaCLI(['fit', '--config', sys.argv[1], '--trainer.max_steps', sys.argv[2],\n"
        "                  '--trainer.default_root_dir', workdir + '/run', '--trainer.logger.init_args.store_dir', workdir + '/mlruns'])\n"
        "wait = next(c for c in cli.trainer.callbacks if isinstance(c, StepTimeBreakdown))\n"
        "print('DATA_WAIT', wait.total_data_wait, wait.total_step)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, RECIPE, str(steps)], capture_output=True, text=True, check=True)
    waited, total = (float(v) for v in done.stdout.split("DATA_WAIT")[-1].split())
    return waited / total, waited, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=None, help="LeRobot dataset; default: the embedded planar-arm dataset")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recipe-steps", type=int, default=300, help="0 skips the recipe measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the loader's collation in the main process (0 workers) runs single-threaded, as in workers

    def datamodule(workers: int) -> RobotDataModule:
        dm = RobotDataModule(root=args.root, loader={"num_workers": workers, "persistent_workers": False})
        dm.setup("fit")
        return dm

    frames = frames_of_first_batches(datamodule(0), args.batches)
    timed_frames = len(frames) * (args.batches - 1) / args.batches  # the loader's clock skips the first batch
    rates: dict[str, list[float]] = {"raw decoder, 1 process": []} | {f"loader, {w} workers": [] for w in args.workers}
    for _ in range(args.rounds):
        rates["raw decoder, 1 process"].append(len(frames) / raw_decode_seconds(frames))
        for workers in args.workers:
            rates[f"loader, {workers} workers"].append(timed_frames / loader_seconds(datamodule(workers), args.batches))
    raw_rate = median(rates["raw decoder, 1 process"])
    print_table(
        f"decoded frames/s, the frames of the first {args.batches} training batches, median of {args.rounds} rounds",
        ["variant", "frames/s", "vs raw decoder"],
        [[name, median(r), median(r) / raw_rate] for name, r in rates.items()],
    )
    if args.recipe_steps:
        fraction, waited, total = recipe_wait_fraction(args.recipe_steps)
        print_table(
            f"default pretrain recipe, {args.recipe_steps} steps",
            ["data wait (s)", "step time (s)", "wait fraction"],
            [[waited, total, f"{100 * fraction:.2f}%"]],
        )


if __name__ == "__main__":
    main()
