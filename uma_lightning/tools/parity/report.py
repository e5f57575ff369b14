"""The parity report: a table per strategy and one line on where a failed run parts ways."""

from __future__ import annotations

from uma_lightning.parallel.mesh import MESH_DIMS
from uma_lightning.tools.parity.layouts import LAYOUTS, TOLERANCES


def print_report(config: str, results: dict, global_batch: int) -> None:
    steps = len(next(iter(results.values()))["loss_diffs"])
    tol = next(iter(TOLERANCES.values()))
    print(
        f"\nparity of {config}: {steps} steps of global batch {global_batch}, float64, against one process on the whole batch; "
        "each step from the reference's weights"
    )
    print(
        f"mesh: pp x dp_replicate x dp_shard x tp (x ep). loss diff: relative (tolerance {tol.loss:.1e}); grad diff: max abs difference of a "
        f"gradient over its largest element (tolerance {tol.grad:.1e}); update diff: per step |params - reference| / "
        f"|reference update|, L2 over all parameters (tolerance {tol.update:.1e}). margin: tolerance / difference, worst of the three"
    )
    header = [
        "strategy",
        "processes",
        "mesh",
        "max loss diff",
        "max grad diff",
        "max update diff",
        "margin",
        "bitwise vs accum.",
        "result",
    ]
    rows = [header]
    for name, r in results.items():
        mesh = "x".join(str(getattr(LAYOUTS[name][1], dim)) for dim in MESH_DIMS)
        bitwise = ("yes" if r["bitwise_vs_accumulation"] else "no") + (" (required)" if r["bitwise_required"] else "")
        rows.append([
            name, str(LAYOUTS[name][0]), mesh, f"{r['max_loss_diff']:.2e}", f"{r['max_gradient_diff']:.2e}", f"{r['update_diff']:.2e}",
            f"{r['margin']:.2g}", bitwise, "ok" if r["ok"] else "DIVERGED",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print("per-step loss diff:")
    for name, r in results.items():
        print(f"  {name:8s} " + "  ".join(f"{d:.2e}" for d in r["loss_diffs"]))
    for name, r in results.items():
        if not r["ok"]:
            print(explain_failure(name, r))


def explain_failure(name: str, r: dict) -> str:
    """One line on where a failed run first parts ways with the reference."""
    if r["initial_difference"]:
        d = r["initial_difference"]
        return f"{name}: the initial weights already differ from the reference's, first in {d['parameter']} (by {d['max_abs_diff']:.3g}): the plan changed the weights"
    if r["routing_difference"] and not r["first_divergence"]:
        d = r["routing_difference"]
        return f"{name}: at step {d['step']}, {d['layer']} has {d['what']} {d['got']} where one process has {d['expected']}"
    if r["replica_difference"]:
        d = r["replica_difference"]
        return f"{name}: the ranks start from different copies of {d['parameter']} (apart by {d['max_abs_diff']:.3g}): a rank was initialised differently"
    d = r["first_divergence"]
    if d is not None:
        first, largest = d["first"], d["largest"]
        return (
            f"{name}: gradients diverge at step {d['step']} in {d['count']} of {d['of']} parameters. First in model order: "
            f"{first['parameter']}, max abs diff {first['max_abs_diff']:.3g} ({first['relative']:.2e} of its largest element); "
            f"largest: {largest['parameter']} ({largest['relative']:.2e})"
        )
    if r["bitwise_required"] and not r["bitwise_vs_accumulation"]:
        return f"{name}: within tolerance of one process, but not bitwise equal to the rank-ordered accumulation, as its reductions must be"
    return f"{name}: every gradient agrees within {r['gradient_tolerance']:.1e} of its scale; the difference comes from the loss or the optimizer step"
