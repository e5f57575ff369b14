"""Pipeline parallelism on CPU processes: the bubble of each schedule against its formula, and step time against FSDP.

For each group size p (2 and 4 gloo processes) and each microbatch count m, every schedule trains
the same model on the same global batches; the bubble is what ``StepTimeBreakdown`` logs as
``time/pipeline_bubble_fraction``: the share of the schedule's time a stage waits on its
neighbours, averaged over the stages, median over the steps after the first. It is printed
against the formulas for equal stages:

    GPipe, 1F1B                      (p - 1) / (m + p - 1)
    interleaved, v stages per rank   (p - 1) / (v m + p - 1)
    zero bubble                      the interleaved formula (what the weight-gradient filling improves on)

and each step time (median) against FSDP over the same p processes (all of them sharding, each
with its share of the batch) as a ratio.

    python benchmarks/pipeline.py                       # p = 2 and 4, m = 4 and 8
    python benchmarks/pipeline.py --processes 2 --microbatches 2,4,8 --steps 6

A CPU is not a GPU cluster: stages share the machine's cores and memory bandwidth, and the
"network" is shared memory, so the measured bubble also holds the activations' transfer and the
schedule's own bookkeeping, which grow with m.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]


def formula(p: int, m: int, virtual: int) -> float:
    return (p - 1) / (virtual * m + p - 1)


def worker(job_file: str) -> None:
    """One rank: every configuration of the job in turn; rank 0 writes the medians."""
    import copy
    import os

    import torch
    from lightning.pytorch import Callback

    from uma_lightning.parallel import MeshSizes, MeshStrategy, PipelineConfig
    from uma_lightning.parallel.pipeline import pipeline_of
    from uma_lightning.tools.fixed_batches import fit_on_batches

    with open(job_file, "rb") as f:
        job = pickle.load(f)  # written by this script a moment ago, in its private folder

    class Measure(Callback):
        def __init__(self):
            self.steps, self.bubbles = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(time.perf_counter() - self.start)
            pipeline = pipeline_of(pl_module)
            self.bubbles.append(pipeline.bubble_fraction if pipeline else 0.0)

    results = []
    for name, sizes, options in job["runs"]:
        torch.manual_seed(0)
        measure = Measure()
        fit_on_batches(
            copy.deepcopy(job["module"]),
            job["batches"],
            MeshStrategy(MeshSizes(**sizes), PipelineConfig(**options)),
            [measure],
        )
        steps, bubbles = measure.steps[1:], measure.bubbles[1:]  # the first step builds the stages' buffers
        results.append(
            {"name": name, "options": options, "step_s": statistics.median(steps), "bubble": statistics.median(bubbles)}
        )
    if int(os.environ["RANK"]) == 0:
        Path(job["out"]).write_text(json.dumps(results))


def main(argv: list[str]) -> int:
    from uma_lightning.tools.launch import run_local_group
    from uma_lightning.tools.parity import resolve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4", help="comma-separated group sizes")
    parser.add_argument("--microbatches", default="4,8", help="comma-separated microbatch counts")
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps per configuration (the first is not counted)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--size", default=json.dumps({"dim": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256})
    )
    args = parser.parse_args(argv)
    overrides = [
        "--model.network.size",
        args.size,
        "--data.generation.n_episodes",
        "8",
        "--data.loader.num_workers",
        "0",
        "--data.batch_size",
        str(args.batch_size),
    ]
    module, batches, _ = resolve(str(REPO / "recipes" / "pretrain.yaml"), overrides, args.steps)
    microbatches = [int(m) for m in args.microbatches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="uma-pipeline-") as tmp:
        for p in (int(p) for p in args.processes.split(",")):
            runs = [("fsdp", {"dp_shard": p}, {})]
            for m in microbatches:
                for schedule, virtual in SCHEDULES:
                    if m < p or (virtual > 1 and schedule != "ZBVZeroBubble" and m % p):
                        continue
                    runs.append(
                        (
                            schedule,
                            {"pp": p, "dp_shard": 1},
                            {"schedule": schedule, "microbatches": m, "virtual_stages": virtual},
                        )
                    )
            job = {"module": module, "batches": batches, "runs": runs, "out": str(Path(tmp) / f"{p}.json")}
            with open(Path(tmp) / "job.pickle", "wb") as f:
                pickle.dump(job, f)
            run_local_group(worker, p, (str(Path(tmp) / "job.pickle"),), timeout=1800)
            results = json.loads(Path(job["out"]).read_text())
            fsdp = results[0]["step_s"]
            for r in results[1:]:
                o = r["options"]
                rows.append([p, o["schedule"], o["microbatches"], o["virtual_stages"], f"{r['bubble']:.3f}",
                             f"{formula(p, o['microbatches'], o['virtual_stages']):.3f}", f"{1e3 * r['step_s']:.0f}", f"{1e3 * fsdp:.0f}", f"{r['step_s'] / fsdp:.2f}"])  # fmt: skip
    print_table(
        f"pipeline bubble and step time, {args.size}, global batch {args.batch_size}, {args.steps - 1} measured steps (medians)",
        ["p", "schedule", "m", "v", "bubble", "formula", "step ms", "fsdp ms", "vs fsdp"],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
