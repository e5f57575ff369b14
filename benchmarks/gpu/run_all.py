"""Every GPU check and benchmark in one run that fits a short lease of a GPU machine: each part in a
process of its own, in order of what it tells, none started past the time budget, each cut at its cap.

    python benchmarks/gpu/run_all.py --out DIR [--budget 480] [--only checkpoint,strategies]
    python benchmarks/gpu/run_all.py --list

Each part's output is shown as it comes and kept in ``DIR/<part>.log``; the checkpoint benchmark's
ratios go to ``DIR/checkpoint_io.json``. The summary gives every part's exit status and seconds
(124: cut at its cap; its output up to then is in its log). Exits 1 if any part failed or was cut.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def parts(out: Path) -> dict[str, tuple[list[str], int]]:
    """name: (command, cap in seconds), in the order they run."""
    return {
        "gpu-tests": (
            [PYTHON, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-k", "(gpu or cuda or float8 or prefetcher) and not cpu_smoke",
             "tests/test_checkpoint_io.py", "tests/test_data_pipeline.py", "tests/test_kernels.py"],
            90,
        ),
        "checkpoint": (
            [PYTHON, "benchmarks/checkpoint_io.py", "--device", "cuda", "--repeats", "3", "--json", str(out / "checkpoint_io.json")],
            150,
        ),
        "kernels": ([PYTHON, "benchmarks/gpu/kernels.py", "--skip", "rl"], 240),
        "strategies": ([PYTHON, "benchmarks/gpu/strategies.py", "--steps", "20"], 240),
        "rl": ([PYTHON, "benchmarks/gpu/rl_throughput.py", "--seconds", "20"], 150),
        "video": ([PYTHON, "benchmarks/gpu/video_decode.py"], 60),
    }  # fmt: skip


def run_part(command: list[str], cap: float, log: Path) -> int:
    """Run ``command`` from the repository's root, its output to the terminal and ``log``; 124 if cut at ``cap``."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as kept:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
        deadline = time.monotonic() + cap
        os.set_blocking(process.stdout.fileno(), False)
        while True:
            chunk = process.stdout.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                kept.write(chunk)
            if process.poll() is not None and not chunk:
                return process.returncode
            if time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)  # its workers and actors too
                process.wait()
                message = f"\n--- cut at its cap of {cap:.0f} s ---\n".encode()
                sys.stdout.buffer.write(message)
                kept.write(message)
                return 124
            if not chunk:
                time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the logs and the checkpoint benchmark's JSON")
    parser.add_argument("--budget", type=float, default=480, help="seconds in all; no part starts after them")
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the parts, their caps and commands, and exit")
    args = parser.parse_args()
    out = args.out or Path("gpu-results")
    every = parts(out)
    if args.list:
        for name, (command, cap) in every.items():
            print(f"{name:<11} cap {cap:>3} s  {' '.join(Path(c).name if c == PYTHON else c for c in command)}")
        return 0
    chosen = [name for name in args.only.split(",") if name] or list(every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(every)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    for name in chosen:
        command, cap = every[name]
        left = args.budget - (time.monotonic() - started)
        if left < 10:
            results.append((name, "not started: the budget is spent", 0.0))
            continue
        print(f"\n##### {name} (cap {min(cap, left):.0f} s): {' '.join(command[1:])}", flush=True)
        began = time.monotonic()
        code = run_part(command, min(cap, left), out / f"{name}.log")
        results.append((name, f"exit {code}", time.monotonic() - began))
    print("\n##### summary")
    for name, outcome, seconds in results:
        print(f"{name:<11} {outcome:<36} {seconds:6.0f} s")
    print(f"in all {time.monotonic() - started:.0f} s")
    return 0 if all(outcome == "exit 0" for _, outcome, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
