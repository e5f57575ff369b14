"""``uma parity --precision bf16-mixed`` (or ``16-mixed``): where does low precision lose most?

The same steps on the same global batches train twice, in fp32 and in the chosen precision (for
16-mixed with its grad scaler), on one process or under one strategy. As in the strategy check,
each step of both runs starts from the weights of a one-process fp32 run, so the errors of one
step do not carry into the next. Per layer (every module holding parameters of its own) the
report gives the relative error against fp32, in L2 and at the worst step, of

- its output in the first micro-batch (under a strategy: rank 0's part, the same part in both runs);
- the gradients of its parameters (full tensors).

Layers are ranked by that error, the first in forward order first among equals, so a layer
that overflows heads the list, before the layers its infinities reach. A layer is flagged when
an error is not finite or exceeds ``FLAG_UNITS`` units of the precision's rounding: a candidate
to keep in fp32.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from uma_lightning.parallel.mesh import MeshSizes
from uma_lightning.tools.launch import run_local_group
from uma_lightning.tools.parity.recorded_runs import train, worker

# Unit roundoff of each low precision (half its machine epsilon): bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF = {"bf16-mixed": 2.0**-8, "16-mixed": 2.0**-11}
# One rounding moves a matmul output by ~1 unit; errors then grow with depth, through the norms'
# division and the softmax. Measured on the tests' two-layer model: at most 2 units (bf16, 8.2e-3)
# and 3 (fp16, 1.4e-3) in any layer. 64 units leaves room for deeper models and stays far below
# an overflow (infinite).
FLAG_UNITS = 64
TOP = 8  # layers listed in the report
# The 16-mixed grad scaler starts here, not at torch's 2^16: a few steps are too few for it to come
# down from there (each overflow skips a step and halves it), and a real run spends its time at
# the scale where gradients stop overflowing. Steps it still skips are reported, their gradients not compared.
INIT_SCALE = 2.0**8


def compare_precision(
    module,
    batches: list[dict],
    trainer_args: dict,
    precision: str,
    layout: tuple[int, MeshSizes] | None,
    strategy_args: dict,
    timeout: float = 600,
) -> dict:
    """Train in fp32 and in ``precision`` (on one process, or on ``layout``'s processes and mesh sizes in a
    local group), each step from the weights of a one-process fp32 run; per-layer errors of the low-precision run against fp32."""

    def job(chosen: str, trajectory=None) -> dict:
        # As a plugin: strategies refuse the 16-mixed flag.
        plugin = (
            MixedPrecision(
                chosen,
                "cpu",
                scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if chosen == "16-mixed" else None,
            )
            if chosen != "32-true"
            else None
        )
        args = {**trainer_args, **({"plugins": [plugin]} if plugin else {"precision": "32-true"})}
        return {
            "module": module,
            "batches": batches,
            "trainer_args": args,
            "trajectory": trajectory,
            "strategy_args": strategy_args,
            "activations": True,
        }

    with tempfile.TemporaryDirectory(prefix="uma-precision-") as tmp:
        work = Path(tmp)
        reference = train(job("32-true"), None, work / "fp32.pt", activations=True)
        if layout is None:
            fp32 = reference
            low = train(job(precision, reference["params"]), None, work / "low.pt", activations=True)
        else:
            world_size, sizes = layout
            runs = [
                (job(name, reference["params"]), [{"sizes": sizes, "out": str(work / f"{name}.pt")}])
                for name in ("32-true", precision)
            ]
            torch.save(runs, work / "runs.pt")  # see parity.check_parity
            run_local_group(worker, world_size, (str(work / "runs.pt"),), timeout)
            fp32, low = (torch.load(work / f"{name}.pt", weights_only=True) for name in ("32-true", precision))
    return layer_errors(fp32, low, precision)


def layer_errors(fp32: dict, low: dict, precision: str) -> dict:
    """Per layer, in forward order: the worst-step relative L2 error of its output and of its parameters' gradients."""
    order = fp32["layer_order"]
    layers = {name: {"layer": name, "activation": 0.0, "gradient": 0.0} for name in order}
    for ref_step, low_step in zip(fp32["activations"], low["activations"]):
        for name, ref in ref_step.items():
            layers[name]["activation"] = max(layers[name]["activation"], _relative(low_step.get(name), ref))
    # Non-finite gradients make the grad scaler skip the step: not a layer's error, unless the output overflowed.
    skipped = [
        k
        for k, grads in enumerate(low["grads"], start=1)
        if precision == "16-mixed" and not all(torch.isfinite(g).all() for g in grads.values())
    ]
    for step, (ref_grads, low_grads) in enumerate(zip(fp32["grads"], low["grads"]), start=1):
        if step in skipped:
            continue
        by_layer: dict[str, list[tuple]] = {}
        for name, ref in ref_grads.items():
            by_layer.setdefault(name.rsplit(".", 1)[0], []).append((low_grads.get(name), ref))
        for name, pairs in by_layer.items():
            if name in layers:
                layers[name]["gradient"] = max(layers[name]["gradient"], _relative_all(pairs))
    bound = FLAG_UNITS * UNIT_ROUNDOFF[precision]
    for entry in layers.values():
        entry["error"] = max(entry["activation"], entry["gradient"])
        entry["flagged"] = not entry["error"] <= bound
    ranked = sorted(layers.values(), key=lambda e: (-e["error"], order.index(e["layer"])))
    return {
        "ok": not any(e["flagged"] for e in ranked),
        "precision": precision,
        "bound": bound,
        "ranked": ranked,
        "flagged": [e["layer"] for e in ranked if e["flagged"]],
        "loss_diffs": [abs(a - b) for a, b in zip(low["losses"], fp32["losses"])],
        "skipped_steps": skipped,
    }


def _relative(value: torch.Tensor | None, reference: torch.Tensor) -> float:
    return _relative_all([(value, reference)])


def _relative_all(pairs: list[tuple]) -> float:
    """sqrt(sum |value - reference|^2) / sqrt(sum |reference|^2) over the pairs; inf where a value is missing or not finite."""
    diff = scale = 0.0
    for value, reference in pairs:
        if value is None or value.shape != reference.shape:
            return math.inf
        diff += float((value - reference).pow(2).sum())
        scale += float(reference.pow(2).sum())
    if math.isnan(diff):
        return math.inf
    return math.sqrt(diff / scale) if scale else (0.0 if diff == 0 else math.inf)


def print_precision_report(config: str, precision: str, results: dict, global_batch: int) -> None:
    for where, r in results.items():
        steps = len(r["loss_diffs"])
        print(
            f"\n{precision} against fp32 for {config} ({where}): {steps} steps of global batch {global_batch}, each from the same fp32 weights. "
            f"Relative L2 error at the worst step; flagged above {r['bound']:.2g} ({FLAG_UNITS} units of {precision} rounding) or not finite"
        )
        print("per-step |loss diff|: " + "  ".join(f"{d:.2e}" for d in r["loss_diffs"]))
        if r["skipped_steps"]:
            print(
                f"the grad scaler skipped step(s) {', '.join(map(str, r['skipped_steps']))} (gradients not finite): their gradients are not compared"
            )
        rows = [["layer", "output error", "gradient error", ""]]
        for e in r["ranked"][:TOP]:
            rows.append(
                [e["layer"], f"{e['activation']:.2e}", f"{e['gradient']:.2e}", "FLAGGED" if e["flagged"] else ""]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if r["flagged"]:
            print(
                f"{len(r['flagged'])} layer(s) lose more than {precision} should, first {r['flagged'][0]}: candidates to keep in fp32"
            )
        else:
            print(f"ok: every layer within {r['bound']:.2g} of fp32")


def plot_precision(path: str, precision: str, results: dict, top: int = 2 * TOP) -> None:
    """A horizontal bar per layer (the ``top`` worst, worst on top) of its error against fp32, flagged
    layers in red, the flag bound dashed; one panel per comparison (one process, or each strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(min(top, len(r["ranked"])) for r in results.values())
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.2 + 0.28 * rows * len(results)), squeeze=False)
    for ax, (where, r) in zip(axes[:, 0], results.items()):
        worst = r["ranked"][:top][::-1]
        # A non-finite error is drawn at the edge of the axis, in red (it is flagged).
        finite = [e["error"] for e in worst if math.isfinite(e["error"]) and e["error"] > 0]
        edge = max(finite + [r["bound"]]) * 4
        errors = [e["error"] if math.isfinite(e["error"]) else edge for e in worst]
        colours = ["tab:red" if e["flagged"] else "tab:blue" for e in worst]
        ax.barh([e["layer"] for e in worst], errors, color=colours)
        ax.axvline(r["bound"], color="gray", linestyle="--", label=f"flag bound {r['bound']:.2g}")
        ax.set_xscale("log")
        ax.set_title(f"{precision} against fp32 ({where}): {len(r['flagged'])} of {len(r['ranked'])} layers flagged")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("relative L2 error at the worst step (larger of output and gradient)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
