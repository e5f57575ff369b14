"""SIGKILL across the board: kills at random moments drawn over every strategy preset and both model
stages, each followed by a rerun of the same command that must end bit for bit where the
uninterrupted run ends (every model and optimizer tensor of the final checkpoint).

A kill's moment (``tests/kill_and_rerun.py``): the forward or backward pass of a step on one rank,
the write of a checkpoint on one rank, or its commit (rank 0, before or after the rename). Every
(strategy, stage) comes once, in an order drawn from the seed, before any comes again; the phases
are taken in turn. The pipeline strategy runs the pretrain stage only: the flow model cannot be
pipelined. hsdp, fsdp_tp and ep_fsdp run on 4 processes (2 x 2), the rest on 2; the models are tiny,
8 steps, a checkpoint every 2. Each uninterrupted run is trained once and cached (``--cache``).

    python benchmarks/sigkill_matrix.py [--seed 0] [--kills 20] [--cache DIR] [--json FILE]

Exits 1 unless every kill happened where drawn and its rerun resumed from the newest committed
checkpoint and ended bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests")]
from harness import print_table  # noqa: E402
from kill_and_rerun import draw_moments, kill_and_rerun, reference, world_size  # noqa: E402

from uma_lightning.cache_dir import default_cache_dir  # noqa: E402
from uma_lightning.progress import Progress  # noqa: E402

log = logging.getLogger("uma_lightning")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the kills' moments")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument(
        "--cache", type=Path, default=default_cache_dir() / "sigkill_matrix", help="the uninterrupted runs"
    )
    parser.add_argument("--json", type=Path, help="also write every kill's outcome here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    moments = draw_moments(args.seed, args.kills)
    log.info("seed %d: %d kills over %d (strategy, stage) pairs", args.seed, len(moments), len({(m.strategy, m.stage) for m in moments}))  # fmt: skip
    rows, outcomes, failed = [], [], 0
    with tempfile.TemporaryDirectory() as work, Progress(len(moments), "kills", "kill", every_s=0) as progress:
        for index, moment in enumerate(moments, 1):
            started = time.monotonic()
            checkpoint = reference(moment.strategy, moment.stage, args.cache)
            reference_s = time.monotonic() - started
            try:
                outcome = kill_and_rerun(moment, Path(work) / f"kill{index:02d}", checkpoint)
            except RuntimeError as err:  # not killed where drawn, or a rerun that failed: a row that says so
                log.info("kill %d: %s", index, str(err).splitlines()[0])
                outcomes.append({"moment": moment.__dict__, "error": str(err), "bitwise": False})
                failed += 1
                rows.append([index, moment.strategy, moment.stage, world_size(moment.strategy), moment.describe(),
                             moment.step, "-", "error", "no", round(time.monotonic() - started, 1)])  # fmt: skip
                progress.advance(1)
                continue
            outcomes.append(outcome.to_json())
            verdict = "yes" if outcome.bitwise else f"no ({len(outcome.different)} tensors differ)"
            failed += not (outcome.bitwise and outcome.resumed_as_expected)
            rows.append([index, moment.strategy, moment.stage, world_size(moment.strategy), moment.describe(),
                         moment.step, outcome.newest_before_rerun, "yes" if outcome.resumed_as_expected else "no",
                         verdict, outcome.seconds])  # fmt: skip
            log.info(
                "kill %d: %s %s, step %d, %s: killed at %s; rerun from step %d, bitwise %s (%.1f s%s)",
                index, moment.strategy, moment.stage, moment.step, moment.describe(), outcome.killed_at, outcome.newest_before_rerun,
                verdict, outcome.seconds, f", reference {reference_s:.1f} s" if reference_s > 1 else "",
            )  # fmt: skip
            progress.advance(1)
    print_table(
        f"SIGKILL matrix, seed {args.seed}",
        ["#", "strategy", "stage", "ranks", "killed at", "step", "rerun from", "resumed", "bitwise", "seconds"],
        rows,
    )
    bitwise = sum(outcome["bitwise"] for outcome in outcomes)
    print(f"\n{bitwise} of {len(outcomes)} bitwise")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "kills": outcomes}, indent=1, default=str))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
