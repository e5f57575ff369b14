"""``uma plan``: the parallel layout for a recipe on a cluster, ranked by estimated throughput.

    uma plan --config recipes/pretrain.yaml --model.network.size 7b --nodes 4 --gpus-per-node 8 --gpu h200

The recipe and its overrides resolve as in ``uma fit``; the model is built on the meta device.
Every layout of the cluster's GPUs is estimated (``estimate.py``); those that fit are ranked by
tokens/s, the others listed with their reason. ``--emit-config`` writes the recommendation as a
fragment to add after the recipe. A layout counts as legal only if the strategy's own checks
accept it (``layout.strategy_refusal``), so what is recommended is what ``uma fit`` runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from uma_lightning.checkpoint import CheckpointError
from uma_lightning.cli_errors import ConfigError
from uma_lightning.tools.planner import report
from uma_lightning.tools.planner.calibrate import measured_mfu
from uma_lightning.tools.planner.cluster import (
    ACCELERATORS,
    DISK_GB_S,
    GIB,
    LINK_PRESETS,
    Cluster,
    Link,
    preset_link,
)
from uma_lightning.tools.planner.estimate import Estimate, Settings, rank
from uma_lightning.tools.planner.memory import Precision
from uma_lightning.tools.planner.model import ModelFacts, facts_of_stage

GPUS_PER_NODE_TRIED = (1, 2, 4, 8)  # node shapes tried when looking for the smallest cluster that fits
MAX_NODES_TRIED = 128


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uma plan",
        description="Rank the parallel layouts of a recipe on a cluster by estimated tokens/s, with per-GPU memory.",
        epilog="Other arguments override recipe keys, as in uma fit (e.g. --model.network.size 7b).",
    )
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100", help=f"accelerator: {', '.join(ACCELERATORS)}")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory per GPU (default: the accelerator's; cpu: the host's over its processes)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="dense peak per GPU for the run's precision (default: the MFU table's; cpu: a probe)",
    )
    parser.add_argument(
        "--intra-node",
        default=None,
        help=f"link preset inside a node: {', '.join(LINK_PRESETS)} (default nvlink; cpu: loopback)",
    )
    parser.add_argument("--inter-node", default="ib-ndr", help=f"link preset between nodes: {', '.join(LINK_PRESETS)}")
    parser.add_argument(
        "--intra-node-gb-s", type=float, help="override the intra-node bandwidth (GB/s per GPU and direction)"
    )
    parser.add_argument(
        "--inter-node-gb-s", type=float, help="override the inter-node bandwidth (GB/s per GPU and direction)"
    )
    parser.add_argument(
        "--disk-gb-s",
        type=float,
        default=DISK_GB_S,
        help="checkpoint write bandwidth per node, GB/s (local NVMe, or the node's share of a shared file system)",
    )
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="achievable fraction of peak FLOP/s for the model's matmuls"
    )
    parser.add_argument(
        "--calibrate-from", metavar="RUN_DIR", help="use the median MFU a finished run logged instead of --mfu"
    )
    parser.add_argument(
        "--global-batch", type=int, help="samples per optimizer step (default: data.batch_size per GPU, times the GPUs)"
    )
    parser.add_argument(
        "--precision", help="Lightning precision (default: the recipe's; if empty, bf16-mixed on GPUs, 32-true on cpu)"
    )
    parser.add_argument("--top", type=int, default=12, help="rows of the ranked table and of the rejected list")
    parser.add_argument("--json", action="store_true", help="print everything as JSON instead")
    parser.add_argument(
        "--emit-config", metavar="FILE", help="write the recommended layout as a fragment to add after the recipe"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="chart memory per GPU and tokens/s of every candidate")
    return parser


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    try:
        check_arguments(args)
        if args.calibrate_from:
            try:
                args.mfu = measured_mfu(args.calibrate_from)
            except (ValueError, CheckpointError) as err:
                raise ConfigError(f"--calibrate-from: {err}") from None
        stage, batch_size, recipe_precision = resolve(args.config, overrides)
        facts = facts_of_stage(stage)
        precision = precision_of(
            args.precision or recipe_precision or ("32-true" if args.gpu == "cpu" else "bf16-mixed"),
            bool(args.precision),
        )
        cluster = build_cluster(args, precision, args.nodes, args.gpus_per_node)
    except ConfigError as err:
        print(f"uma: error: {err}", file=sys.stderr)
        return 2
    settings = Settings(args.global_batch or batch_size * cluster.world_size, precision, args.mfu)
    fits, rejected = rank(facts, cluster, settings)
    recommended = fits[0] if fits else None
    smallest = None if recommended else smallest_cluster(facts, args, precision, batch_size)
    if args.emit_config and recommended:
        Path(args.emit_config).write_text(report.fragment(recommended, cluster, settings, args.config))
    if args.plot:
        try:
            report.plot(args.plot, fits, rejected, recommended, cluster, facts.throughput_unit)
        except ImportError:
            print("uma: error: --plot: needs matplotlib (pip install matplotlib; mlflow installs it)", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report.as_json(facts, cluster, settings, fits, rejected, recommended, smallest), indent=1))
        return 0 if recommended else 1
    print_plan(facts, cluster, settings, fits, rejected, recommended, smallest, args)
    return 0 if recommended else 1


def check_arguments(args) -> None:
    """One-line errors for values no cluster has."""
    for name in ("nodes", "gpus_per_node", "global_batch", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be a positive integer, got {value}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu: must be a fraction in (0, 1], got {args.mfu}")
    if args.gpu not in ACCELERATORS:
        raise ConfigError(f"--gpu: unknown accelerator {args.gpu!r} (choose from {', '.join(ACCELERATORS)})")
    for name in ("intra_node", "inter_node"):
        if getattr(args, name) is not None and getattr(args, name) not in LINK_PRESETS:
            raise ConfigError(
                f"--{name.replace('_', '-')}: unknown link preset {getattr(args, name)!r} (choose from {', '.join(LINK_PRESETS)})"
            )
    for name in ("gpu_memory_gib", "peak_tflops", "intra_node_gb_s", "inter_node_gb_s", "disk_gb_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {value}")


def resolve(config: str, overrides: list[str]):
    """The recipe's stage module, its per-rank batch size, and its precision as the recipe sets it (None: left to the device)."""
    from uma_lightning.cli import UmaCLI, resolve_recipe

    class PlanCLI(UmaCLI):
        def before_instantiate_classes(self) -> None:
            self.precision_asked = self.config["trainer"].get("precision")  # before the CPU default fills it in
            super().before_instantiate_classes()

    cli = resolve_recipe(config, overrides, PlanCLI)
    precision = cli.precision_asked
    return cli.model, cli.datamodule.hparams.batch_size, None if precision is None else str(precision)


def precision_of(name: str, asked: bool) -> Precision:
    try:
        return Precision.of(str(name))
    except ValueError as err:
        raise ConfigError(f"{'--precision' if asked else 'trainer.precision'}: {err}") from None


def build_cluster(args, precision: Precision, nodes: int, gpus_per_node: int) -> Cluster:
    from uma_lightning.callbacks.peak_flops import PEAK_TFLOPS, matmul_dtype, resolve_peak

    accelerator = ACCELERATORS[args.gpu]
    dtype = matmul_dtype(precision.name)
    if args.peak_tflops:
        peak = args.peak_tflops
    elif args.gpu == "cpu":
        import torch

        peak = resolve_peak(torch.device("cpu"), precision.name)[0]  # the MFU callback's figure for this host
    elif dtype not in PEAK_TFLOPS[accelerator.name]:
        raise ConfigError(
            f"--precision: the peak table has no {dtype} figure for {accelerator.name}; give --peak-tflops"
        )
    else:
        peak = PEAK_TFLOPS[accelerator.name][dtype]
    memory = args.gpu_memory_gib or accelerator.memory_gib or _host_memory_gib() / gpus_per_node
    try:
        intra = preset_link(args.intra_node or ("loopback" if args.gpu == "cpu" else "nvlink"), accelerator)
        inter = preset_link(args.inter_node, accelerator)
    except ValueError as err:
        raise ConfigError(f"--intra-node: {err}") from None
    if args.intra_node_gb_s:
        intra = Link(args.intra_node_gb_s, intra.latency_us)
    if args.inter_node_gb_s:
        inter = Link(args.inter_node_gb_s, inter.latency_us)
    return Cluster(nodes, gpus_per_node, accelerator, memory, peak, intra, inter, args.disk_gb_s)


def _host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / GIB


def smallest_cluster(facts: ModelFacts, args, precision: Precision, batch_size: int) -> str | None:
    """The fewest GPUs of the same kind (nodes of 1, 2, 4 or 8) on which some layout fits."""
    shapes = sorted(
        (
            (nodes, per_node)
            for per_node in GPUS_PER_NODE_TRIED
            for nodes in range(1, MAX_NODES_TRIED + 1)
            if nodes == 1 or per_node == max(GPUS_PER_NODE_TRIED)
        ),
        key=lambda shape: (shape[0] * shape[1], shape[0]),
    )
    for nodes, per_node in shapes:
        cluster = build_cluster(args, precision, nodes, per_node)
        settings = Settings(args.global_batch or batch_size * cluster.world_size, precision, args.mfu)
        fits, _ = rank(facts, cluster, settings)
        if fits:
            best = fits[0]
            return (
                f"--nodes {nodes} --gpus-per-node {per_node} (global batch {settings.global_batch}): {best.layout.describe()}, "
                f"{best.peak_bytes / GIB:.1f} GiB per GPU, est. {best.throughput:,.0f} {best.unit}/s"
            )
    return None


def print_plan(facts: ModelFacts, cluster: Cluster, settings: Settings, fits: list[Estimate], rejected: list[Estimate],
               recommended: Estimate | None, smallest: str | None, args) -> None:  # fmt: skip
    params = sum(math.prod(p.shape) for p in facts.params)
    if facts.cfg:
        b = facts.cfg.backbone
        what = f"{b.name} backbone ({b.n_layers} layers, dim {b.dim})"
    else:
        what = (
            f"{type(facts.model).__name__} ({facts.n_units} data-parallel units; no registered plan: sized for ddp, "
            "fsdp, hsdp and its tp_plan without activation checkpointing, its activations from a traced step)"
        )
    per_sample = (
        f"{facts.tokens_per_sample} tokens per sample"
        if facts.tokens_per_sample
        else "no tokens_per_sample (throughput in samples/s)"
    )
    print(
        f"model: {what}, {params / 1e9:.3g} B parameters, {per_sample}, "
        f"{facts.flops_per_sample / 1e12:.3g} TFLOP per sample (training)"
    )
    print(f"cluster: {cluster.describe()}")
    print(
        f"step: global batch {settings.global_batch}, {settings.precision.name}, compute at {settings.mfu:.1%} of peak ({'measured by ' + args.calibrate_from if args.calibrate_from else '--mfu'})\n"
    )
    if fits:
        print(f"{len(fits)} layouts fit; the {min(args.top, len(fits))} fastest:")
        print("\n".join(report.ranked_table(fits, args.top)))
        print("the fastest of each strategy:")
        print("\n".join(report.best_per_strategy(fits)))
        print()
    print("\n".join(report.rejected_lines(rejected, args.top)))
    print()
    if recommended is None:
        needed = min((e for e in rejected if e.memory), key=lambda e: e.peak_bytes, default=None)
        least = f" (the leanest layout needs {needed.peak_bytes / GIB:.1f} GiB per GPU)" if needed else ""
        print(
            f"impossible: no layout fits {cluster.nodes} x {cluster.gpus_per_node} {cluster.accelerator.name} with {cluster.memory_gib:g} GiB each{least}."
        )
        print(
            f"smallest cluster that fits: {smallest}"
            if smallest
            else f"nothing up to {MAX_NODES_TRIED} nodes of {max(GPUS_PER_NODE_TRIED)} fits."
        )
        return
    print(f"recommended: {recommended.layout.describe()} ({recommended.layout.strategy_name()}), est. {recommended.throughput:,.0f} {recommended.unit}/s, "
          f"step {recommended.step_s * 1e3:.0f} ms (compute {recommended.compute_s * 1e3:.0f} ms, exposed communication {recommended.exposed_comm_s * 1e3:.1f} ms)")  # fmt: skip
    print("\n".join(report.memory_bars(recommended, cluster)))
    print(report.checkpoint_line(recommended, cluster))
    print("\n".join(report.collective_lines(recommended, cluster)))
    print(
        "\nfragment"
        + (f" (written to {args.emit_config})" if args.emit_config else " (--emit-config FILE writes it)")
        + ":"
    )
    print(report.fragment(recommended, cluster, settings, args.config))
