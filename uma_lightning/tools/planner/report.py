"""What ``uma plan`` prints and writes: the ranked table, the reasons for the rejected, the
recommendation with its memory bars and collectives, the strategy fragment, JSON and a chart."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import yaml

from uma_lightning.tools.planner.cluster import GIB, Cluster
from uma_lightning.tools.planner.comm import crosses_nodes, seconds
from uma_lightning.tools.planner.estimate import USABLE_MEMORY, Estimate, Settings
from uma_lightning.tools.planner.model import ModelFacts

BAR_WIDTH = 50


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i and cell[:1].isdigit() else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def ranked_table(fits: list[Estimate], top: int) -> list[str]:
    rows = [["#", "layout", "GiB/GPU", "step ms", "comm ms", "bubble", f"{fits[0].unit}/s"]]
    for index, e in enumerate(fits[:top], start=1):
        rows.append([
            str(index), e.layout.describe(), f"{e.peak_bytes / GIB:.1f}", f"{e.step_s * 1e3:.1f}", f"{e.exposed_comm_s * 1e3:.1f}",
            f"{e.bubble:.0%}", f"{e.throughput:,.0f}",
        ])  # fmt: skip
    legend = "mb: micro-batches per step (a pipeline's, or gradient accumulation); v2: two virtual stages per rank; comm ms: communication compute does not hide"
    return _table(rows) + [legend]


def best_per_strategy(fits: list[Estimate]) -> list[str]:
    """The fastest layout of each strategy family (pp and ep ones included), so none hides below the table."""
    best: dict[str, Estimate] = {}
    for e in fits:
        best.setdefault(e.layout.strategy_name(), e)
    return [
        f"  {name:12s} {e.throughput:>12,.0f} {e.unit}/s  {e.peak_bytes / GIB:6.1f} GiB  {e.layout.describe()}"
        for name, e in best.items()
    ]


def rejected_lines(rejected: list[Estimate], top: int) -> list[str]:
    """The rejected layouts grouped by the kind of reason, with the most common reasons first."""
    kinds = Counter(_reason_kind(e.rejected) for e in rejected)
    lines = [
        f"{len(rejected)} layouts rejected: " + ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
    ]
    # The closest misses first: per kind of reason, its first examples in turn.
    by_kind: dict[str, list[str]] = {}
    for e in sorted(rejected, key=lambda e: e.peak_bytes if e.memory else 0):
        examples = by_kind.setdefault(_reason_kind(e.rejected), [])
        if len(examples) < top:
            examples.append(f"  {e.layout.describe()}: {e.rejected}")
    lines += [line for round_ in itertools.zip_longest(*by_kind.values()) for line in round_ if line][:top]
    return lines


def _reason_kind(reason: str) -> str:
    # The first marker found names the kind: the strategy's own messages (layout.strategy_refusal) start with the option they refuse.
    for marker, kind in (("GiB per GPU", "out of memory"), ("crosses nodes", "tp across nodes"), ("mixture-of-experts", "no tp for experts"),
                         ("ep ", "expert layouts"), ("micro-batches", "micro-batch counts"), ("microbatches", "micro-batch counts"),
                         ("pipeline.schedule", "pipeline schedules"), ("pp:", "pipeline splits"), ("does not divide", "shapes tp cannot split"),
                         ("global batch", "batch splits")):  # fmt: skip
        if marker in reason:
            return kind
    return "other"


def memory_bars(e: Estimate, cluster: Cluster) -> list[str]:
    usable = cluster.memory_gib * USABLE_MEMORY * GIB
    lines = [
        f"memory per GPU: {e.peak_bytes / GIB:.1f} of {usable / GIB:.1f} GiB usable ({USABLE_MEMORY:.0%} of {cluster.memory_gib:g})"
    ]
    for part, size in e.memory.items():
        bar = "#" * round(BAR_WIDTH * size / usable)
        lines.append(f"  {part:12s} {bar:<{BAR_WIDTH}} {size / GIB:7.2f} GiB")
    return lines


def checkpoint_line(e: Estimate, cluster: Cluster) -> str:
    return (
        f"checkpoint: {e.checkpoint_bytes / 1e9:.2f} GB of parameters and optimizer state per rank, "
        f"{e.save_s * cluster.disk_gb_s:.1f} GB written per node (replicas write their shared shards once); "
        f"a save takes {e.save_s:.1f} s at {cluster.disk_gb_s:g} GB/s per node (--disk-gb-s)"
    )


def collective_lines(e: Estimate, cluster: Cluster) -> list[str]:
    rows = [["collective", "kind", "group", "link", "MB per call", "calls", "ms", "overlaps compute"]]
    for c in e.collectives:
        link = "across nodes" if crosses_nodes(c.group, c.stride, cluster) else "in a node"
        rows.append(
            [
                c.what,
                c.kind,
                str(c.group),
                link,
                f"{c.bytes / 1e6:.2f}",
                str(c.calls),
                f"{seconds(c, cluster) * 1e3:.2f}",
                "yes" if c.overlaps_compute else "no",
            ]
        )
    return _table(rows) if len(rows) > 1 else ["no collectives (one rank)"]


def fragment(e: Estimate, cluster: Cluster, settings: Settings, recipe: str) -> str:
    """A strategy fragment in the style of ``configs/strategy/*.yaml`` that sets ``e.layout`` on this cluster."""
    layout = e.layout
    # MeshStrategy's sections: every size (the numbers for this cluster), and what the estimate assumed.
    init_args = {
        "sizes": dataclasses.asdict(layout.sizes()),
        "wrapping": {"activation_checkpointing": layout.ac},
    }
    if layout.pp > 1:
        init_args["pipeline"] = {
            "schedule": layout.schedule,
            "microbatches": layout.microbatches,
            "virtual_stages": layout.virtual_stages,
        }
    accumulate = layout.microbatches if layout.pp == 1 else 1
    per_rank = settings.global_batch // layout.dp // accumulate
    config = {
        "trainer": {
            "num_nodes": cluster.nodes,
            "devices": cluster.gpus_per_node,
            "accumulate_grad_batches": accumulate,
            "strategy": {"class_path": "uma_lightning.parallel.MeshStrategy", "init_args": init_args},
        },
        "data": {"init_args": {"batch_size": per_rank}},
    }
    header = (
        f"# Written by uma plan: {layout.describe()} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.accelerator.name}, "
        f"global batch {settings.global_batch}.\n# Estimated {e.throughput:,.0f} {e.unit}/s, {e.peak_bytes / GIB:.1f} GiB per GPU. "
        f"Use after the recipe: uma fit --config {recipe} --config THIS_FILE\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)


def as_json(
    facts: ModelFacts,
    cluster: Cluster,
    settings: Settings,
    fits: list[Estimate],
    rejected: list[Estimate],
    recommended: Estimate | None,
    smallest: str | None,
) -> dict:
    def one(e: Estimate) -> dict:
        return {
            "layout": dataclasses.asdict(e.layout),
            "strategy": e.layout.strategy_name(),
            "memory_bytes": e.memory,
            "peak_bytes": e.peak_bytes,
            "compute_s": e.compute_s,
            "bubble": e.bubble,
            "exposed_comm_s": e.exposed_comm_s,
            "step_s": e.step_s,
            f"{e.unit}_per_s": e.throughput,
            "checkpoint_bytes_per_rank": e.checkpoint_bytes,
            "save_s": e.save_s,
            "collectives": [{**dataclasses.asdict(c), "seconds": seconds(c, cluster)} for c in e.collectives],
            "rejected": e.rejected,
        }

    return {
        "model": {
            "network": type(facts.model).__name__,
            "size": facts.cfg.backbone.name if facts.cfg else None,
            "parameters": sum(math.prod(p.shape) for p in facts.params),
            "seq_len": facts.cfg.seq_len if facts.cfg else None,
            "tokens_per_sample": facts.tokens_per_sample,
            "throughput_unit": facts.throughput_unit,
            "training_flops_per_sample": facts.flops_per_sample,
        },  # fmt: skip
        "cluster": {**dataclasses.asdict(cluster), "world_size": cluster.world_size},
        "settings": {"global_batch": settings.global_batch, "precision": settings.precision.name, "mfu": settings.mfu},
        "ranked": [one(e) for e in fits],
        "rejected": [{"layout": dataclasses.asdict(e.layout), "reason": e.rejected} for e in rejected],
        "recommended": one(recommended) if recommended else None,
        "smallest_cluster_that_fits": smallest,
    }


def plot(
    path: str, fits: list[Estimate], rejected: list[Estimate], recommended: Estimate | None, cluster: Cluster, unit: str
) -> None:
    """Estimated memory per GPU against throughput (``unit``/s: tokens, or samples) for every candidate with
    numbers (those that fit, and those too big)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    too_big = [e for e in rejected if e.memory]
    fig, ax = plt.subplots(figsize=(9, 6))
    for group, colour, label in ((fits, "tab:blue", "fits"), (too_big, "tab:red", "does not fit")):
        ax.scatter(
            [e.peak_bytes / GIB for e in group],
            [e.throughput for e in group],
            s=10,
            c=colour,
            alpha=0.5,
            label=f"{label} ({len(group)})",
        )
    ax.axvline(
        cluster.memory_gib * USABLE_MEMORY,
        color="gray",
        linestyle="--",
        label=f"usable memory ({cluster.memory_gib * USABLE_MEMORY:.0f} GiB)",
    )
    if recommended:
        ax.scatter([recommended.peak_bytes / GIB], [recommended.throughput], s=120, marker="*", c="gold", edgecolors="black", zorder=3,
                   label=f"recommended: {recommended.layout.describe()}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("estimated memory per GPU (GiB)")
    ax.set_ylabel(f"estimated {unit}/s")
    ax.set_title(f"uma plan: every layout on {cluster.nodes} x {cluster.gpus_per_node} {cluster.accelerator.name}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
