"""Cost of the replica checksum (``ReplicaChecksum``): one checksum of every weight of the `small`
model against one training step of it, in the same `uma fit` run on one process.

A check's local part is what this times: ``weight_checksums`` over every parameter (one read of the
weights), after each step's optimizer update, as the callback does. Its collective, one all-gather of
two int64 numbers per weight (a few hundred bytes), is latency-bound and not timed here. Step time is
the wall time between consecutive step ends, data wait included, with the first steps dropped.
The cost per step is a check's time over ``every_n_steps`` (100 in configs/trainer/diagnostics.yaml).

    python benchmarks/replica_checksum.py [--steps 12] [--batch-size 8] [--every-n-steps 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from harness import median, print_table, small_model_fit

from uma_lightning.callbacks.replica_checksum import weight_checksums
from uma_lightning.cli import UmaCLI

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "pretrain.yaml")
WARMUP_STEPS = 2
STEP_ENDS: list[float] = []
CHECK_SECONDS: list[float] = []
WEIGHTS: list[tuple[int, int]] = []  # (tensors, bytes)


class TimedChecksum(L.Callback):
    """Ends each step's timing, then times a checksum of every weight (outside the step's time)."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        STEP_ENDS.append(time.perf_counter())
        parameters = list(pl_module.parameters())
        start = time.perf_counter()
        weight_checksums(parameters).tolist()  # the host sync a check makes
        CHECK_SECONDS.append(time.perf_counter() - start)
        WEIGHTS[:] = [(len(parameters), sum(p.numel() * p.element_size() for p in parameters))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--every-n-steps", type=int, default=100)
    args = parser.parse_args()
    sys.argv = sys.argv[:1]  # the CLI under test must not see this script's flags
    with tempfile.TemporaryDirectory() as tmp:
        UmaCLI(
            small_model_fit(
                RECIPE,
                args.steps,
                args.batch_size,
                Path(tmp) / "run",
                "--trainer.logger",
                "false",
                "--trainer.callbacks",
                json.dumps([{"class_path": "__main__.TimedChecksum"}]),
            )  # fmt: skip
        )
    # Between two step ends: the check after the first, then the second step.
    steps = [b - a - c for a, b, c in zip(STEP_ENDS, STEP_ENDS[1:], CHECK_SECONDS)][WARMUP_STEPS - 1 :]
    checks = CHECK_SECONDS[WARMUP_STEPS:]
    step, check = median(steps), median(checks)
    tensors, size = WEIGHTS[0]
    print_table(
        f"replica checksum, small model ({tensors} tensors, {size / 2**20:.1f} MiB), batch {args.batch_size}, "
        f"{len(steps)} timed steps, {torch.get_num_threads()} threads",
        ["step ms", "check ms", "check / step %", f"per step at every {args.every_n_steps} %"],
        [[step * 1e3, check * 1e3, 100 * check / step, 100 * check / step / args.every_n_steps]],
    )


if __name__ == "__main__":
    main()
