"""What TensorBoard's profiler plugin finds in the traces `ProfilerTraces` writes, read by the plugin itself.

Trains a short tiny pretrain run with the profiler on (two recorded windows; or takes --logdir, a
run's `profiler/` folder), then starts the plugin (torch-tb-profiler) on that folder as
`tensorboard --logdir` would and prints each run it lists with its views, workers and spans, and
the steps of its overview.

    pip install tensorboard torch-tb-profiler
    python benchmarks/tensorboard_profiler.py --out /tmp/tb_profiler [--logdir runs/pretrain/profiler]

Not part of the test suite (tests/test_diagnostics.py reads the folder the way the plugin does):
the plugin is not a dependency, and parses each trace in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}


def profiled_run(run_dir: Path) -> Path:
    """A 12-step tiny run recording steps 5-6 and 10-11; returns its profiler folder."""
    uma = shutil.which("uma", path=str(Path(sys.executable).parent)) or "uma"
    command = [uma, "fit", "--config", str(REPO / "recipes" / "pretrain.yaml"),
               "--model.network.size", json.dumps(TINY), "--data.generation.n_episodes", "6",
               "--data.loader.num_workers", "0", "--trainer.max_steps", "12", "--trainer.val_check_interval", "12",
               "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
               "--trainer.default_root_dir", str(run_dir),
               "--trainer.callbacks+=uma_lightning.callbacks.ProfilerTraces",
               "--trainer.callbacks.init_args.skip_first", "2", "--trainer.callbacks.init_args.wait", "2",
               "--trainer.callbacks.init_args.active", "2", "--trainer.callbacks.init_args.repeat", "2"]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run_dir / "profiler"


def plugin_runs(logdir: Path, timeout_s: float = 300) -> dict:
    """The runs the plugin has loaded from ``logdir`` once it has finished loading."""
    from tensorboard.plugins.base_plugin import TBContext
    from torch_tb_profiler.plugin import TorchProfilerPlugin

    plugin = TorchProfilerPlugin(TBContext(logdir=str(logdir)))
    deadline = time.monotonic() + timeout_s
    time.sleep(1)  # its monitor thread scans the log directory as it starts
    while plugin.is_loading and time.monotonic() < deadline:
        time.sleep(0.5)
    with plugin._runs_lock:  # what its /runs route answers
        return dict(plugin._runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the profiled run")
    parser.add_argument("--logdir", type=Path, help="a run's profiler folder (default: profile a new run)")
    args = parser.parse_args()
    logdir = args.logdir or profiled_run(args.out / "run")
    print(f"log directory {logdir}: {sorted(p.relative_to(logdir).as_posix() for p in logdir.rglob('*.json'))}")
    runs = plugin_runs(logdir)
    print(f"the plugin lists {len(runs)} run(s)")
    for name, run in runs.items():
        print(f"run {name}: views {[view.display_name for view in run.views]}")
        for worker in run.workers:
            spans = run.get_spans(worker)
            profile = run.get_profile(worker, spans[0] if spans else None)
            steps = [row[0] for row in profile.overview["steps"]["rows"]] if profile and profile.overview else []
            print(f"  worker {worker}: spans {spans}, overview steps {steps}")


if __name__ == "__main__":
    main()
