"""uma plan's predictions against a real step on four gloo CPU processes, per strategy and model.

For the tiny and small presets on the pretrain recipe's data shapes, under ddp, fsdp, tp, hsdp,
fsdp_tp, pp 4, pp 2 with ddp and with fsdp, and for a size with experts (tiny_moe) under ep and ep_fsdp
(``planner/check.py``): rank 0's parameter, gradient and AdamW bytes (predicted exactly on every
rank, per stage under pp), the bytes of every collective of one step, and the activations a
saved-tensors hook sees in the forward. One launch per model.

    python benchmarks/planner.py                       # tiny, small and tiny_moe, global batch 8
    python benchmarks/planner.py --sizes tiny,tiny_moe --strategies pp,pp_ddp,pp_fsdp,ep,ep_fsdp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def model_config(size: str):
    """The pretrain recipe's model at ``size``, with its data's shapes."""
    import torch

    from uma_lightning.cli import resolve_recipe

    cli = resolve_recipe(
        str(REPO / "recipes" / "pretrain.yaml"), ["--model.network.size", size, "--data.loader.num_workers", "0"]
    )
    with torch.device("meta"):
        return cli.model.build_model().cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="tiny,small,tiny_moe",
        help="model sizes; those with experts run the ep layouts, the others the dense ones",
    )
    parser.add_argument("--strategies", help="only these rows (names in planner/check.py's LAYOUTS and EXPERT_LAYOUTS)")
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    from uma_lightning.tools.planner.check import EXPERT_LAYOUTS, LAYOUTS, compare
    from uma_lightning.tools.planner.layout import Layout

    rows = []
    for size in args.sizes.split(","):
        cfg = model_config(size)
        layouts = dict(EXPERT_LAYOUTS if cfg.backbone.moe else LAYOUTS)
        if "tp" in layouts and (cfg.backbone.n_heads % LAYOUTS["tp"].tp or cfg.backbone.n_kv_heads % LAYOUTS["tp"].tp):
            # tiny's 6 heads and 2 key/value heads do not split over 4 ranks: tp 2 in each of 2 replicas.
            layouts["tp"] = Layout(dp_replicate=2, tp=2)
        if args.strategies:
            layouts = {name: layout for name, layout in layouts.items() if name in args.strategies.split(",")}
        if not layouts:
            continue
        for name, ranks in compare(
            {name: (cfg, layout) for name, layout in layouts.items()}, args.global_batch
        ).items():
            measured, predicted = ranks[0]["measured"], ranks[0]["predicted"]
            comm_m, comm_p = sum(measured["collectives"].values()), sum(predicted["collectives"].values())
            exact = all(r["measured"][k] == r["predicted"][k] for r in ranks for k in ("params", "grads", "optimizer"))
            rows.append([
                size, f"{name} ({layouts[name].describe().split(' |')[0]})", f"{measured['params'] / 2**20:.3f}", f"{predicted['params'] / 2**20:.3f}",
                f"{measured['optimizer'] / 2**20:.3f}", f"{predicted['optimizer'] / 2**20:.3f}", "yes" if exact else "NO",
                f"{comm_m / 2**20:.2f}", f"{comm_p / 2**20:.2f}", f"{comm_p / comm_m - 1:+.1%}" if comm_m else "-",
                f"{measured['activations'] / 2**20:.2f}", f"{predicted['activations'] / 2**20:.2f}", f"{predicted['activations'] / measured['activations'] - 1:+.1%}",
            ])  # fmt: skip
    print_table(
        f"uma plan: predicted against measured, rank 0 of 4 gloo processes, global batch {args.global_batch}, fp32, one step (MiB)",
        [
            "model",
            "strategy",
            "params",
            "pred.",
            "AdamW",
            "pred.",
            "state exact on all ranks",
            "collectives",
            "pred.",
            "error",
            "activations",
            "pred.",
            "error",
        ],  # fmt: skip
        rows,
    )


if __name__ == "__main__":
    main()
