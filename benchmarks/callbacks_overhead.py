"""Cost of the diagnostics: `uma fit` step time of the `small` model on CPU with every callback on
against every callback off.

"On" is every callback the pretrain recipe's fragments switch on (progress log, throughput and
MFU, step-time breakdown, memory, gradient anomalies, hang watchdog; checkpointing aside) plus the
profiler from configs/trainer/profile.yaml, scheduled to record one of the timed steps. "Off" has no
callback at all. Both log to MLflow, skip validation and checkpoints, and see the same batches.
Step time is the wall time between consecutive step ends, data wait included; the first steps
(start-up) are dropped, the variants alternate round by round, and the ratio is of medians. The
median leaves out the one profiled step by design (profiling is switched on for a few steps when
someone asks for it); the mean, printed too, includes it.

On a shared machine two runs' step times differ by more than the few percent under test, so the
"on" runs also time the callbacks' own per-batch hooks directly; their median per step over the
median step time is the overhead with the machine's noise taken out; it is printed per callback too.

    python benchmarks/callbacks_overhead.py [--steps 12] [--rounds 2] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from harness import median, print_table, small_model_fit

from uma_lightning.cli import UmaCLI

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "pretrain.yaml")
WARMUP_STEPS = 2
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "on_before_optimizer_step",
    "on_train_batch_end",
)
STEP_ENDS: list[float] = []
# Per batch: each callback's own time in its hooks, and under NORM_PASS the time of per-parameter
# gradient norm passes, wherever they run (in a hook, that hook's time includes it).
HOOK_SECONDS: list[dict[str, float]] = []
NORM_PASS = "gradient norm pass"


class StepTimer(L.Callback):
    def on_train_batch_start(self, *args) -> None:
        HOOK_SECONDS.append({})

    def on_train_batch_end(self, *args) -> None:
        STEP_ENDS.append(time.perf_counter())


def timed(function, account: str):
    """``function``, its time added to the current batch's ``account``."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if HOOK_SECONDS:
                HOOK_SECONDS[-1][account] = HOOK_SECONDS[-1].get(account, 0.0) + time.perf_counter() - start

    wrapper.timed_hook = True
    return wrapper


def time_gradient_norms() -> None:
    """Times every per-parameter gradient norm pass. Each step takes one for its grad_norm (measured
    with or without clipping): in clipping, or earlier in GradientAnomalies' hook, which clipping then
    reuses. Moved, not added: the callbacks' own cost is their hooks' time without it."""
    torch._foreach_norm = timed(torch._foreach_norm, NORM_PASS)


def time_hooks_of(callbacks: list[dict]) -> None:
    """Wraps the per-batch hooks each callback class defines itself with a timer."""
    for spec in callbacks:
        module, name = spec["class_path"].rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        for hook in PER_BATCH_HOOKS:
            # Not __wrapped__: rank_zero_only (ProgressLog's hook) sets that too.
            if hook in vars(cls) and not getattr(vars(cls)[hook], "timed_hook", False):
                setattr(cls, hook, timed(vars(cls)[hook], name))


def all_callbacks(profiled_step: int) -> list[dict]:
    """The callbacks of the recipe's trainer fragments and the profiler's, checkpointing left out."""
    callbacks = []
    for fragment in ("default", "diagnostics", "profile"):
        trainer = yaml.safe_load((REPO / "configs" / "trainer" / f"{fragment}.yaml").read_text())["trainer"]
        callbacks += trainer.get("callbacks", []) + trainer.get("callbacks+", [])
    callbacks = [c for c in callbacks if not c["class_path"].endswith(("ShardedCheckpoint", "Preemption"))]
    for callback in callbacks:
        if callback["class_path"].endswith("ProfilerTraces"):
            callback["init_args"] = {
                **callback.get("init_args", {}),
                "skip_first": profiled_step - 1,
                "warmup": 1,
                "active": 1,
            }
    return callbacks


def step_times(
    callbacks: list[dict], steps: int, batch_size: int, workdir: Path
) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds per step, and seconds per step each callback spent in its hooks (and the norm passes
    took), start-up steps dropped."""
    STEP_ENDS.clear()
    HOOK_SECONDS.clear()
    UmaCLI(
        small_model_fit(
            RECIPE,
            steps,
            batch_size,
            workdir / "run",
            "--trainer.logger.init_args.store_dir",
            str(workdir / "mlruns"),
            # StepTimer first: it opens each batch's hook account before the others run.
            "--trainer.callbacks",
            json.dumps([{"class_path": "__main__.StepTimer"}] + callbacks),
        )  # fmt: skip
    )
    return [b - a for a, b in zip(STEP_ENDS, STEP_ENDS[1:])][WARMUP_STEPS - 1 :], HOOK_SECONDS[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    sys.argv = sys.argv[:1]  # the CLI under test must not see this script's flags
    on_callbacks = all_callbacks(profiled_step=args.steps - 2)
    time_hooks_of(on_callbacks)
    time_gradient_norms()
    rows, on_all, off_all, hooks_all, hooks_off = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            on, hooks = step_times(on_callbacks, args.steps, args.batch_size, Path(tmp) / f"on{round_index}")
            off, without = step_times([], args.steps, args.batch_size, Path(tmp) / f"off{round_index}")
            on_all += on
            off_all += off
            hooks_all += hooks
            hooks_off += without
            rows.append([round_index, median(off) * 1e3, median(on) * 1e3, median(on) / median(off)])
    rows.append(["all", median(off_all) * 1e3, median(on_all) * 1e3, median(on_all) / median(off_all)])
    print_table(
        f"callbacks overhead, small model, batch {args.batch_size}, {args.steps} steps per run "
        f"({len(on_all)} timed per variant), {torch.get_num_threads()} threads",
        ["round", "all off ms/step", "all on ms/step", "ratio of medians"],
        rows,
    )
    print(f"ratio of means (the profiled step included): {statistics.mean(on_all) / statistics.mean(off_all):.4f}")
    totals = [sum(seconds for name, seconds in step.items() if name != NORM_PASS) for step in hooks_all]
    names = sorted({name for step in hooks_all for name in step} - {NORM_PASS})
    norms_on = [step.get(NORM_PASS, 0.0) for step in hooks_all]
    norms_off = [step.get(NORM_PASS, 0.0) for step in hooks_off]
    print_table(
        "each callback's own per-batch hooks (medians per step)",
        ["callback", "ms per step", "of the step", "max ms"],
        [
            [
                name,
                median([step.get(name, 0.0) for step in hooks_all]) * 1e3,
                f"{median([step.get(name, 0.0) for step in hooks_all]) / median(on_all):.2%}",
                max(step.get(name, 0.0) for step in hooks_all) * 1e3,
            ]
            for name in names
        ],
    )
    # Each step's norm pass, in GradientAnomalies' hook where it runs, is the one clipping takes otherwise.
    in_hooks = [max(0.0, total - norm) for total, norm in zip(totals, norms_on)]
    print(
        f"gradient norm pass: {median(norms_on) * 1e3:.1f} ms per step with the callbacks on (in GradientAnomalies' "
        f"hook; clipping reuses it), {median(norms_off) * 1e3:.1f} ms per step with them off (in clipping)"
    )
    print(
        f"callbacks' own hooks: median {median(totals) * 1e3:.1f} ms per step = "
        f"{100 * median(totals) / median(on_all):.2f}% of the median step with callbacks on, the norm pass included; "
        f"{median(in_hooks) * 1e3:.1f} ms = {100 * median(in_hooks) / median(on_all):.2f}% without it (goal <= 1%), "
        f"max {max(totals) * 1e3:.0f} ms; on/off {median(on_all) / median(off_all):.3f}x (goal <= 1.02x)"
    )
    print("callbacks on: " + ", ".join(c["class_path"].rsplit(".", 1)[1] for c in on_callbacks))


if __name__ == "__main__":
    main()
