"""``uma report steptime RUN_DIR --plot FILE.png``: draw what a finished run logged, read from the
MLflow run its newest checkpoint names."""

from __future__ import annotations

import argparse
import statistics
import sys

from uma_lightning.tools.planner.step_time import plot_step_time, step_time_parts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uma report", description="Draw what a finished run logged.")
    commands = parser.add_subparsers(dest="command", required=True)
    steptime = commands.add_parser("steptime", help="StepTimeBreakdown's parts of every logged step, as stacked bars")
    steptime.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (its config.yaml and checkpoints)")
    steptime.add_argument("--plot", metavar="FILE.png", required=True, help="where to draw the chart")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        parts = step_time_parts(args.run_dir)
        plot_step_time(args.plot, parts, f"step time of {args.run_dir}")
    except ValueError as err:
        print(f"uma report: error: {err}", file=sys.stderr)
        return 2
    except ImportError:
        print(
            "uma report: error: --plot: needs matplotlib (pip install matplotlib; mlflow installs it)", file=sys.stderr
        )
        return 2
    for part, values in parts.items():
        if values:
            print(
                f"{part.replace('_', ' '):>10}: median {statistics.median(values.values()):.1f} ms over {len(values)} steps"
            )
    return 0
