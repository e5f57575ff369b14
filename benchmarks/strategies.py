"""Step time and peak memory per rank of each strategy on the CPU, two processes, tiny and small models.

    python benchmarks/strategies.py [--sizes tiny,small] [--steps 6] [--batch 8]

Every strategy trains on the same global batches (each data-parallel rank on its slice; the
tensor-parallel ranks on the whole batch), so a step does the same work everywhere and the
speed-up column compares like with like: one process's step time over the strategy's. Memory
is the peak resident memory a rank gains from the start of training (model, gradients,
optimizer state, activations), sampled around every forward, backward and optimizer step.
Each configuration runs in fresh processes, so no run inherits another's memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil
import torch
from harness import median, print_table
from lightning.pytorch import Callback

from uma_lightning.data import RobotDataModule
from uma_lightning.modules import NetworkConfig, OptimizerConfig, PretrainModule
from uma_lightning.parallel import MeshSizes, MeshStrategy
from uma_lightning.tools.fixed_batches import fit_on_batches
from uma_lightning.tools.launch import run_local_group

STRATEGIES = {
    "one process": None,
    "ddp": MeshSizes(dp_replicate=2, dp_shard=1),
    "fsdp": MeshSizes(dp_shard=2),
    "tp": MeshSizes(dp_shard=1, tp=2),
}


class StepMeter(Callback):
    """Seconds per training step and the peak resident memory gained since training started."""

    def __init__(self):
        self.process = psutil.Process()
        self.start_rss = 0
        self.peak_rss = 0
        self.step_times: list[float] = []
        self._step_start = 0.0

    def setup(self, trainer, pl_module, stage):
        self.start_rss = self.peak_rss = self.process.memory_info().rss  # before the model is built

    def _sample(self, *_):
        self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)

    on_before_backward = on_after_backward = on_before_optimizer_step = _sample

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sample()
        self.step_times.append(time.perf_counter() - self._step_start)


def train(job: str, sizes: MeshSizes | None, out: str) -> None:
    """One rank: train the job's module on its batches and write the measurements of this rank."""
    spec = torch.load(job, weights_only=False)
    meter = StepMeter()
    trainer = fit_on_batches(
        spec["module"], spec["batches"], MeshStrategy(sizes) if sizes else "auto", [meter], precision="32-true"
    )
    record = {"step_s": median(meter.step_times[1:]), "peak_mib": (meter.peak_rss - meter.start_rss) / 2**20}
    Path(f"{out}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run; the first is not timed")
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration runs; medians are reported")
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = RobotDataModule(generation={"n_episodes": 20}, batch_size=args.batch, loader={"num_workers": 0})
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.steps)]
    measured: dict[tuple[str, str], list[list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            module = PretrainModule(
                spec=data.spec, network=NetworkConfig(size=size), optimizer=OptimizerConfig(warmup_steps=1)
            )
            job = str(Path(tmp) / f"{size}.pt")
            torch.save({"module": module, "batches": batches}, job)
            # Rounds alternate the strategies, so a slow spell of a shared machine hits them all.
            for round_ in range(args.rounds):
                for name, sizes in STRATEGIES.items():
                    out = str(Path(tmp) / f"{size}-{name}-{round_}")
                    world = 1 if sizes is None else 2
                    print(f"{size} / {name}: {world} process(es), {args.steps} steps, round {round_ + 1}", flush=True)
                    run_local_group(train, world, (job, sizes, out))
                    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
                    measured.setdefault((size, name), []).append(ranks)
    rows = []
    for (size, name), rounds in measured.items():
        step = median([max(r["step_s"] for r in ranks) for ranks in rounds])  # the slowest rank sets the pace
        baseline = median([max(r["step_s"] for r in ranks) for ranks in measured[(size, "one process")]])
        memory = " / ".join(f"{max(ranks[i]['peak_mib'] for ranks in rounds):.0f}" for i in range(len(rounds[0])))
        rows.append([size, name, len(rounds[0]), step, baseline / step, args.batch / step, memory])
    print_table(
        f"strategies on {psutil.cpu_count()} CPU cores (gloo), global batch {args.batch}, fp32; median step time over "
        f"steps 2..{args.steps} and {args.rounds} round(s); speed-up: one process's step time / the strategy's",
        ["model", "strategy", "processes", "step s", "speed-up", "samples/s", "peak MiB per rank"],
        rows,
    )


if __name__ == "__main__":
    main()
