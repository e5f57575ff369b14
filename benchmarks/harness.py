"""Small helpers shared by the benchmarks: side-by-side timing, medians, and a plain-text table.

Machines are noisy, so every benchmark measures its variants in the same run, alternating them,
and reports medians and ratios rather than absolute times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median(values: list[float]) -> float:
    return statistics.median(values)


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def small_model_fit(recipe: str, steps: int, batch_size: int, run_dir, *extra: str) -> list[str]:
    """``uma fit`` arguments for timing steps of the small model: no validation, no checkpoints."""
    return [
        "fit", "--config", recipe,
        "--model.network.size", "small",
        "--data.batch_size", str(batch_size),
        "--trainer.max_steps", str(steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false",
        "--trainer.default_root_dir", str(run_dir),
        *extra,
    ]  # fmt: skip
