"""No false alarms from ``uma parity``: model shapes drawn at random, under every strategy.

    python benchmarks/parity_sweep.py [--shapes 20] [--first-seed 0] [--steps 3] [--config recipes/pretrain.yaml] [--json out.json]

Each shape (``uma_lightning.tools.parity.random_network``: layers, width, heads, kv heads,
feed-forward width, vision tokenizer, environment-state head) trains on the recipe's first
batches under ddp, fsdp, tp, hsdp and fsdp_tp (the shapes are dense: ep and ep_fsdp need
experts); every shape of a group size shares one launch.
All are correct strategies, so every verdict must be ok. Reported: shapes x strategies, false
alarms (must be 0), and the worst margin to tolerance (tolerance / largest difference: how many
times over the worst case still fits), per strategy and overall.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness import print_table

from uma_lightning.tools.parity import LAYOUTS, Case, check_parity, needs_experts, random_network, resolve

DATA = ["--data.generation.n_episodes", "6", "--data.loader.num_workers", "0", "--data.batch_size", "8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "recipes" / "pretrain.yaml"))
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()

    started = time.monotonic()
    seeds = range(args.first_seed, args.first_seed + args.shapes)
    strategies = [name for name in LAYOUTS if not needs_experts(name)]
    cases = []
    for seed in seeds:
        module, batches, trainer_args = resolve(args.config, [*random_network(seed), *DATA], args.steps)
        cases.append(Case(f"shape {seed}", module, batches, strategies, trainer_args))
    results = check_parity(cases)

    rows, alarms = [], []
    for seed, case in zip(seeds, cases):
        shape = " ".join(random_network(seed)[1::2])
        for name, result in results[case.label].items():
            rows.append(
                [
                    seed,
                    name,
                    f"{result['max_loss_diff']:.1e}",
                    f"{result['max_gradient_diff']:.1e}",
                    f"{result['update_diff']:.1e}",
                    f"{result['margin']:.2g}",
                    "ok" if result["ok"] else "FALSE ALARM",
                ]
            )
            if not result["ok"]:
                alarms.append((seed, name, shape))
    print_table(
        "every shape under every strategy",
        ["seed", "strategy", "loss diff", "grad diff", "update diff", "margin", "verdict"],
        rows,
    )
    worst = {name: min(results[c.label][name]["margin"] for c in cases) for name in strategies}
    print_table(
        "worst margin to tolerance per strategy",
        ["strategy", "worst margin"],
        [[n, f"{m:.3g}"] for n, m in worst.items()],
    )
    print(f"\nshapes: {len(cases)}, strategies: {len(strategies)}, runs: {len(rows)}; false alarms: {len(alarms)}; "
          f"worst margin overall: {min(worst.values()):.3g}; {time.monotonic() - started:.0f} s")  # fmt: skip
    for seed, name, shape in alarms:
        print(f"false alarm: shape {seed} ({shape}) under {name}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "false_alarms": alarms, "worst_margin": worst}, indent=2)
        )
    raise SystemExit(1 if alarms else 0)


if __name__ == "__main__":
    main()
