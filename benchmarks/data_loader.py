"""Data loader throughput against the raw decoder, per worker count, and the data-wait share of a training step.

1. Decoded frames/s of the training loader (RobotDataModule: shuffled order, random access into the
   videos, normalisation, collation) for each worker count, against PyAV decoding the very same
   frames in one process in the cheapest order: file by file, each file's frames in time order
   (no seeking back). The clock starts at the second batch, after worker start-up; with --preset
   realistic at batch --warmup-batches, once each worker's decoded-frame cache has filled (the
   warm-up batches are timed apart and printed too). Rounds alternate the variants; medians and
   ratios are printed, the loader's per worker (loader frames/s / (workers x raw frames/s)).
2. The fraction of step time spent waiting for data in `uma fit` (as measured by its
   StepTimeBreakdown callback): the default pretrain recipe, or with --preset realistic the
   `small` model on the realistic data.
3. With --preset realistic: the datasets of `uma data generate --preset realistic` (3 cameras of
   224x224 at 30 fps, AV1 and H.264 at GOP 2; --gops adds long-GOP variants), generated once into
   the cache, and the decoded-frame store (`uma data cache`): its frames/s reading the frames of the
   same batches against a plain memory copy of the same bytes.

    python benchmarks/data_loader.py [--batches 60] [--workers 0 1 2] [--rounds 2] [--recipe-steps 300]
    python benchmarks/data_loader.py --preset realistic [--episodes 40] [--warmup-batches 40] [--gops 2 150] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from harness import median, print_table

from uma_lightning.data import LeRobotMetadata, RobotDataModule, VideoReader
from uma_lightning.data.frame_store import build_store, default_store_dir, open_store
from uma_lightning.data.generate import RealisticPreset, default_cache_dir, ensure_realistic
from uma_lightning.data.order import EpochOrder

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "pretrain.yaml")
STORE_ROUNDS = 7


def frames_of_batches(dm: RobotDataModule, batches: range) -> list[tuple[Path, float]]:
    """(video file, time) of every frame the given training batches (of the first epoch) hold."""
    loader = dm.train_dataloader()
    order = EpochOrder(loader.stream.layouts, dm.order, epoch=0)
    frames = []
    for b in batches:
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


def loader_seconds(dm: RobotDataModule, windows: list[range]) -> list[float]:
    """Seconds the loader takes to hand out each window of consecutive batches, in one pass; the
    batches before the first window are not timed."""
    iterator = iter(dm.train_dataloader())
    for _ in range(windows[0].start):
        next(iterator)
    seconds = []
    for window in windows:
        start = time.perf_counter()
        for _ in window:
            next(iterator)
        seconds.append(time.perf_counter() - start)
    return seconds


def store_and_memcpy_seconds(dm: RobotDataModule, n_batches: int) -> tuple[float, float, int]:
    """(seconds reading the first batches' frames from the frame store, seconds copying as many bytes
    in the same pieces from memory, bytes): each sample's frames per camera, as the loader reads them;
    medians of alternating passes."""
    source, store = dm.train_sets[0], dm.train_sets[0].frame_store
    loader = dm.train_dataloader()
    order = EpochOrder(loader.stream.layouts, dm.order, epoch=0)
    reads = []
    for b in range(n_batches):
        for row in order.batch(b)[1].tolist():
            episode, t = source.locate(row)
            timestamps = source.metadata.read_episode(episode).timestamp.astype(np.float64)
            steps = timestamps[np.clip(t + source.obs_offsets, 0, len(timestamps) - 1)]
            for camera in source.metadata.cameras:
                relative, start = source.metadata.episodes[episode].videos[camera]
                reads.append((relative, start + steps))
    nbytes = sum(
        store.frames(relative, times, 1e-4).nbytes for relative, times in reads
    )  # warms the page cache: both sides then read memory
    # The same frames in plain (anonymous) memory, each file's in time order, copied in the same
    # pieces and order as the store is read: only the store's own costs differ.
    needed: dict[str, set[float]] = {}
    for relative, times in reads:
        needed.setdefault(relative, set()).update(times.tolist())
    in_memory, position = {}, {}
    for relative, times in needed.items():
        ordered = sorted(times)
        in_memory[relative] = store.frames(relative, np.asarray(ordered), 1e-4).copy()
        position[relative] = {t: k for k, t in enumerate(ordered)}
    pieces = [(in_memory[relative], position[relative][float(times[0])], len(times)) for relative, times in reads]

    def store_pass() -> None:
        for relative, times in reads:
            store.frames(relative, times, 1e-4)

    def memcpy_pass() -> None:
        for frames, first, count in pieces:
            frames[first : first + count].copy()

    # Each pass is a fraction of a second of memory traffic: alternate several, take medians.
    seconds: dict[str, list[float]] = {"store": [], "memcpy": []}
    for _ in range(STORE_ROUNDS):
        for name, run in (("store", store_pass), ("memcpy", memcpy_pass)):
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return median(seconds["store"]), median(seconds["memcpy"]), nbytes


def recipe_wait_fraction(steps: int, overrides: tuple[str, ...] = ()) -> tuple[float, float, float]:
    """Run the recipe as `uma fit` does, in a fresh process (its own thread settings), and read the
    totals of its StepTimeBreakdown."""
    script = (
        "import sys, tempfile\n"
        "from uma_lightning.callbacks import StepTimeBreakdown\n"
        "from uma_lightning.cli import UmaCLI\n"
        "with tempfile.TemporaryDirectory() as workdir:\n"
        "    cli = UmaCLI(['fit', '--config', sys.argv[1], '--trainer.max_steps', sys.argv[2], *sys.argv[3:],\n"
        "                  '--trainer.default_root_dir', workdir + '/run', '--trainer.logger.init_args.store_dir', workdir + '/mlruns'])\n"
        "wait = next(c for c in cli.trainer.callbacks if isinstance(c, StepTimeBreakdown))\n"
        "print('DATA_WAIT', wait.total_data_wait, wait.total_step)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, RECIPE, str(steps), *overrides], capture_output=True, text=True, check=True
    )
    waited, total = (float(v) for v in done.stdout.split("DATA_WAIT")[-1].split())
    return waited / total, waited, total


def measure_loader(
    root: str | None, workers_list: list[int], windows: list[range], rounds: int, **settings
) -> list[dict[str, float]]:
    """Per window of batches: median frames/s of the raw decoder and of the loader per worker count,
    over `rounds` alternating rounds."""

    def datamodule(workers: int) -> RobotDataModule:
        loader = {"num_workers": workers, "persistent_workers": False, "frame_store": "off"}
        dm = RobotDataModule(root=root, loader=loader, **settings)
        dm.setup("fit")
        return dm

    reference = datamodule(0)
    if windows[-1].stop > len(reference.train_dataloader()):
        raise SystemExit(
            f"the batches measured run to {windows[-1].stop}, past the epoch's {len(reference.train_dataloader())}: use fewer --batches (or --warmup-batches), or a dataset with more episodes"
        )
    frames = [frames_of_batches(reference, window) for window in windows]
    rates: list[dict[str, list[float]]] = [{"raw": []} | {str(w): [] for w in workers_list} for _ in windows]
    for _ in range(rounds):
        for k in range(len(windows)):
            rates[k]["raw"].append(len(frames[k]) / raw_decode_seconds(frames[k]))
        for workers in workers_list:
            for k, seconds in enumerate(loader_seconds(datamodule(workers), windows)):
                rates[k][str(workers)].append(len(frames[k]) / seconds)
    return [{name: median(r) for name, r in window_rates.items()} for window_rates in rates]


def realistic(args: argparse.Namespace) -> None:
    results: dict[str, float] = {}
    rows, ratios = [], []
    settings = dict(
        batch_size=args.batch_size, n_obs_steps=2, val_episodes=0, order={"partitions": 2, "shuffle_buffer": 256}
    )
    roots = {}
    for gop in args.gops:
        for codec in args.codecs:
            start = time.perf_counter()
            roots[codec, gop] = str(ensure_realistic(RealisticPreset(n_episodes=args.episodes, codec=codec, gop=gop)))
            print(
                f"dataset {codec} GOP {gop}: {roots[codec, gop]} ({time.perf_counter() - start:.1f}s to generate or find)"
            )
    # A worker's first batches fill its decoded-frame cache (first touches of every page of it), once
    # in its life: timed apart from the steady state that the rest of a run sees.
    warmup, steady = range(1, args.warmup_batches), range(args.warmup_batches, args.warmup_batches + args.batches)
    warmup_ratios = []
    for (codec, gop), root in roots.items():
        first, rates = measure_loader(root, args.workers, [warmup, steady], args.rounds, **settings)
        for workers in args.workers:
            per_worker = rates[str(workers)] / (max(1, workers) * rates["raw"])
            first_per_worker = first[str(workers)] / (max(1, workers) * first["raw"])
            rows.append(
                [f"{codec} GOP {gop}", workers, rates["raw"], rates[str(workers)], per_worker, first_per_worker]
            )
            if gop == 2:
                ratios.append(per_worker)
                warmup_ratios.append(first_per_worker)
    print_table(
        f"decoded frames/s of training batches {steady.start}-{steady.stop - 1} (3 cameras of 224x224, 2 observation steps), "
        f"median of {args.rounds} rounds; last column: batches {warmup.start}-{warmup.stop - 1}, while the cache fills",
        ["dataset", "workers", "raw decoder, 1 process", "loader", "loader / (workers x raw)", "same, warm-up batches"],
        rows,
    )
    results["loader_vs_raw_per_worker"] = min(ratios)
    results["loader_vs_raw_per_worker_warmup"] = min(warmup_ratios)
    # The frame store, built once from the first dataset.
    root = roots[args.codecs[0], args.gops[0]]
    meta = LeRobotMetadata.load(root)
    directory = default_store_dir(meta, meta.image_size, default_cache_dir())
    if open_store(directory, meta) is None:
        start = time.perf_counter()
        build_store(meta, directory)
        print(f"frame store {directory} written in {time.perf_counter() - start:.1f}s")
    dm = RobotDataModule(root=root, loader={"num_workers": 0, "persistent_workers": False}, **settings)
    dm.setup("fit")
    store_s, memcpy_s, nbytes = store_and_memcpy_seconds(dm, args.batches)
    results["store_vs_memcpy"] = memcpy_s / store_s
    timed = range(1, args.batches)  # the first batch opens the store's files
    store_loader = len(frames_of_batches(dm, timed)) / loader_seconds(dm, [timed])[0]
    print_table(
        f"frame store, the same frames ({nbytes / 2**20:.0f} MiB)",
        [
            "store frames/s",
            "memcpy of the same bytes, frames/s",
            "store / memcpy",
            "loader on the store, 0 workers, frames/s",
        ],
        [
            [
                nbytes / store_s / meta.image_size[0] / meta.image_size[1] / 3,
                nbytes / memcpy_s / meta.image_size[0] / meta.image_size[1] / 3,
                results["store_vs_memcpy"],
                store_loader,
            ]
        ],
    )
    if args.recipe_steps:
        # ViT-B/32's patches: at the recipe's 8-pixel patches, 6 frames of 224x224 make 4.7k tokens.
        overrides = (
            "--model.init_args.network.size",
            "small",
            "--model.init_args.network.vision.patch_size",
            "32",
            "--data.init_args.root",
            root,
            "--data.init_args.batch_size",
            str(args.recipe_batch_size),
            "--data.init_args.loader.num_workers",
            str(max(args.workers)),
            "--model.init_args.optimizer.warmup_steps",
            "1",
            "--trainer.val_check_interval",
            str(args.recipe_steps + 1),
            "--trainer.limit_val_batches",
            "0",
        )
        fraction, waited, total = recipe_wait_fraction(args.recipe_steps, overrides)
        results["data_wait_fraction"] = fraction
        print_table(
            f"uma fit, small model (32-pixel patches) on the realistic {args.codecs[0]} data, batches of {args.recipe_batch_size}, "
            f"{args.recipe_steps} steps, {max(args.workers)} workers",
            ["data wait (s)", "step time (s)", "wait fraction"],
            [[waited, total, f"{100 * fraction:.2f}%"]],
        )
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=None, help="LeRobot dataset; default: the embedded planar-arm dataset")
    parser.add_argument(
        "--preset", choices=("realistic",), default=None, help="the realistic datasets (see above) instead of --root"
    )
    parser.add_argument(
        "--episodes", type=int, default=RealisticPreset.n_episodes, help="--preset realistic: episodes of each dataset"
    )
    parser.add_argument(
        "--gops",
        type=int,
        nargs="+",
        default=[2],
        help="--preset realistic: GOPs to measure (the ratio's goal is on GOP 2)",
    )
    parser.add_argument(
        "--codecs",
        nargs="+",
        choices=("av1", "h264"),
        default=["av1", "h264"],
        help="--preset realistic: codecs to measure",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="--preset realistic: samples per batch")
    parser.add_argument(
        "--recipe-batch-size", type=int, default=8, help="--preset realistic: samples per batch of the uma fit run"
    )
    parser.add_argument("--json", default=None, help="--preset realistic: write the ratios to this file")
    parser.add_argument("--batches", type=int, default=60, help="batches timed")
    parser.add_argument(
        "--warmup-batches", type=int, default=40, help="--preset realistic: batches before the timed ones (timed apart)"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="default: 0 1 2 (realistic: 1 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--recipe-steps", type=int, default=None, help="0 skips the recipe measurement (default 300; realistic: 6)"
    )
    args = parser.parse_args()
    for name in ("batches", "warmup_batches"):  # each window times at least one batch after the first
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be at least 2, got {getattr(args, name)}")
    torch.set_num_threads(
        1
    )  # the loader's collation in the main process (0 workers) runs single-threaded, as in workers
    if args.preset == "realistic":
        args.workers = args.workers or [1, 2]
        args.recipe_steps = 6 if args.recipe_steps is None else args.recipe_steps
        realistic(args)
        return
    args.workers = args.workers or [0, 1, 2]
    args.recipe_steps = 300 if args.recipe_steps is None else args.recipe_steps
    (rates,) = measure_loader(
        args.root, args.workers, [range(1, args.batches)], args.rounds
    )  # the first batch starts the workers
    raw_rate = rates.pop("raw")
    print_table(
        f"decoded frames/s, the frames of training batches 1-{args.batches - 1}, median of {args.rounds} rounds",
        ["variant", "frames/s", "vs raw decoder"],
        [["raw decoder, 1 process", raw_rate, 1.0]]
        + [[f"loader, {w} workers", rate, rate / raw_rate] for w, rate in rates.items()],
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
