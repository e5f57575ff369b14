"""``uma parity``: does a recipe train the same under each strategy as on one process?

    uma parity --config recipes/pretrain.yaml --strategies ddp,fsdp,tp --steps 4 [recipe overrides...]

The recipe's model and data are resolved as ``uma fit`` would, and the first ``--steps`` batches
of its training data become the global batches. Each strategy trains on them in a group of gloo
processes on this machine (2, or 4 for the 2-D meshes hsdp and fsdp_tp), each data-parallel rank
on its equal slice of every global batch, from the same initial weights as the references:

- one process on each whole global batch: the comparison that matters, judged per strategy
  against the tolerance in ``TOLERANCES``, which says why the runs may differ at all;
- one process accumulating gradients over the same slices, in rank order: a data-parallel run
  that adds its ranks' gradients in that order matches it bit for bit.

For a strategy out of tolerance, the report names where the gradients first part ways: the
step, the first differing parameter in model order, and the one that differs most.

Recipe keys are overridden as in ``uma fit`` (``--model.network.size ...``). Keep the model small: the
tool holds every step's full gradients in memory. Runs use fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import Callback

from uma_lightning.cli_errors import ConfigError
from uma_lightning.parallel.fixed_batches import fit_on_batches
from uma_lightning.parallel.launch import run_local_group

log = logging.getLogger("uma_lightning")


@dataclass(frozen=True)
class Tolerance:
    loss: float  # max |loss - reference loss| over the steps
    update: float  # |final params - reference final params| / |reference final params - initial params| (L2 norms)
    why: str


# A correct strategy differs from one process only in the order in which it adds numbers. In
# fp32 a reordered sum moves by ~1e-7 of its size; a loss near 5 by an ulp or two (4.8e-7 each):
# 1e-5 on the loss leaves a wide margin. Parameters are judged by how far the whole update
# moved, in L2, not element by element: AdamW divides each gradient element by its running size,
# so the update of an element whose gradient is near zero can flip sign on noise. Measured on the
# tiny test model over 4-8 steps: 3e-7 (ddp, fsdp, hsdp), 1.3e-6 (tp, fsdp_tp). A real bug moves
# it by 1e-2 or more within a step or two (see tests/test_parallel.py).
TOLERANCES = {
    "ddp": Tolerance(
        1e-5,
        1e-5,
        "each rank sums over its half of the batch inside the matmuls and the all-reduce adds the halves; one process "
        "sums over the whole batch in one matmul, and fp32 addition is not associative. Against one process that "
        "accumulates the same halves in rank order, DDP is bitwise identical: adding two numbers is exact to reorder",
    ),
    "fsdp": Tolerance(
        1e-5,
        1e-5,
        "as ddp for the gradients (the reduce-scatter adds the two halves). Not bitwise even against accumulation while "
        "gradients are clipped: the clipping norm is summed from per-shard norms",
    ),
    "tp": Tolerance(
        1e-5,
        1e-4,
        "row-wise layers add partial matmul products across ranks, in the forward and the backward: every layer "
        "reorders sums, not just the final gradient reduction, so the differences are a few times larger",
    ),
    "hsdp": Tolerance(1e-5, 1e-5, "as fsdp, with four ranks' gradients summed in two stages (within, then across replicas)"),
    "fsdp_tp": Tolerance(1e-5, 1e-4, "the tp and fsdp reorderings together"),
}
# At each step, a gradient differs when its max abs difference exceeds this fraction of the
# reference gradient's largest element; used to locate a divergence, not to judge a strategy.
GRAD_RTOL = 1e-4

# Processes and mesh per strategy: the 2-D meshes use two ranks in each dimension so both are real.
LAYOUTS = {
    "ddp": (2, {"dp_replicate": 2, "dp_shard": 1, "tp": 1}),
    "fsdp": (2, {"dp_replicate": 1, "dp_shard": 2, "tp": 1}),
    "tp": (2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2}),
    "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2, "tp": 1}),
    "fsdp_tp": (4, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}),
}


def data_parallel_size(name: str) -> int:
    sizes = LAYOUTS[name][1]
    return sizes["dp_replicate"] * sizes["dp_shard"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="uma parity",
        description="Does a recipe train the same under each strategy as on one process?",
        epilog="Other arguments override recipe keys, as in uma fit (e.g. --model.network.size tiny --data.batch_size 8).",
    )
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--strategies", default="ddp,fsdp,tp", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=4, help="training steps, one global batch (data.batch_size samples) each")
    parser.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "ops"), help="in the strategy runs")
    parser.add_argument("--ac-every-n-blocks", type=int, default=1)
    parser.add_argument("--compile", default="none", choices=("none", "blocks"), help="in the strategy runs")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True, help="FSDP, in the strategy runs")
    parser.add_argument("--cpu-offload", action="store_true", help="FSDP, in the strategy runs")
    parser.add_argument("--report", help="also write the results as JSON to this file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a group of processes may take")
    args, overrides = parser.parse_known_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    try:
        unknown = [s for s in strategies if s not in LAYOUTS]
        if unknown or not strategies:
            raise ConfigError(f"--strategies: unknown strategy {', '.join(unknown) or '(none given)'}; choose from {', '.join(LAYOUTS)}")
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        module, batches, trainer_args = _resolve(args.config, overrides, args.steps)
        global_batch = len(batches[0]["sample_id"])
        for name in strategies:
            if global_batch % data_parallel_size(name):
                raise ConfigError(
                    f"{name}: global batch {global_batch} (data.batch_size) does not split over {data_parallel_size(name)} data-parallel ranks"
                )
    except ConfigError as err:
        print(f"uma parity: error: {err}", file=sys.stderr)
        return 2

    strategy_args = {
        "activation_checkpointing": args.activation_checkpointing,
        "ac_every_n_blocks": args.ac_every_n_blocks,
        "compile": args.compile,
        "compile_backend": args.compile_backend,
        "reshard_after_forward": args.reshard_after_forward,
        "cpu_offload": args.cpu_offload,
    }
    with tempfile.TemporaryDirectory(prefix="uma-parity-") as tmp:
        work = Path(tmp)
        # Handed to the worker processes as arguments (pickled by multiprocessing, never written to disk).
        job = {"module": module, "batches": batches, "trainer_args": trainer_args}
        log.info("parity: %d steps of global batch %d; references on one process", len(batches), global_batch)
        references = {dp: _train(job, None, work / f"reference{dp}.pt", micro_batches=dp) for dp in sorted({1, *map(data_parallel_size, strategies)})}
        results = {}
        for world_size in sorted({LAYOUTS[name][0] for name in strategies}):
            group = [name for name in strategies if LAYOUTS[name][0] == world_size]
            log.info("parity: %s on %d processes", ", ".join(group), world_size)
            runs = [{"sizes": LAYOUTS[n][1], "out": str(work / f"{n}.pt")} for n in group]
            run_local_group(_worker, world_size, (job, runs, strategy_args), args.timeout)
            for name in group:
                run = torch.load(work / f"{name}.pt", weights_only=True)
                results[name] = compare(name, references[1], references[data_parallel_size(name)], run)
    print_report(args.config, results, global_batch)
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


def _resolve(config: str, overrides: list[str], steps: int):
    """The recipe's (not yet configured) LightningModule, its first ``steps`` training batches, and its gradient clipping."""
    from uma_lightning.cli import UmaCLI

    cli = UmaCLI(["--config", config, *overrides, "--trainer.logger", "false", "--trainer.devices", "1"], run=False)
    cli.datamodule.setup("fit")
    batches = []
    for batch in cli.datamodule.train_dataloader():
        batches.append(batch)
        if len(batches) == steps:
            break
    if len(batches) < steps:
        raise ConfigError(f"{config}: the training data has only {len(batches)} batches, fewer than --steps {steps}")
    trainer_args = {
        # fp32: bf16 rounding would swamp the summation-order differences being checked.
        "precision": "32-true",
        "gradient_clip_val": cli.trainer.gradient_clip_val,
        "gradient_clip_algorithm": cli.trainer.gradient_clip_algorithm,
    }
    return cli.model, batches, trainer_args


# ---- training runs ---------------------------------------------------------------------------------


def _train(job: dict, strategy, out: Path, micro_batches: int = 1) -> dict:
    """Train a fresh copy of the job's module under ``strategy`` (None: one process, accumulating
    gradients over ``micro_batches`` slices of each global batch); rank 0 saves the record to ``out``."""
    recorder = _Recorder(out, micro_batches)
    module = copy.deepcopy(job["module"])  # every run starts from the unconfigured module
    trainer = fit_on_batches(module, job["batches"], strategy or "auto", [recorder], micro_batches, **job["trainer_args"])
    return torch.load(out, weights_only=True) if trainer.is_global_zero else {}


def _worker(job: dict, runs: list[dict], strategy_args: dict) -> None:
    """One rank of a strategy group: trains each listed strategy in turn in the same process group."""
    from uma_lightning.parallel import MeshStrategy

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for run in runs:
        _train(job, MeshStrategy(**run["sizes"], **strategy_args), Path(run["out"]))


class _Recorder(Callback):
    """Per-step global loss and full gradients, and the initial and final full parameters (saved by rank 0)."""

    def __init__(self, out: Path, micro_batches: int, seed: int = 0):
        self.out, self.micro_batches, self.seed = out, micro_batches, seed
        self.batch_losses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.initial: dict[str, torch.Tensor] = {}

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(self.seed)  # configure_model runs next: the same initial weights in every run

    def on_fit_start(self, trainer, pl_module):
        self.initial = _full_params(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({name: _full(p.grad) for name, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # The mean over all ranks is the global batch's loss: every data-parallel slice has the
        # same number of tensor-parallel copies. Under accumulation Lightning reports each
        # micro-batch's loss divided by their number; their sum is the step's loss.
        self.batch_losses.append(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean"))

    def on_train_end(self, trainer, pl_module):
        final = _full_params(pl_module)
        if trainer.is_global_zero:
            n = self.micro_batches
            losses = [float(sum(self.batch_losses[i : i + n])) for i in range(0, len(self.batch_losses), n)]
            torch.save({"losses": losses, "grads": self.grads, "initial": self.initial, "final": final}, self.out)


def _full_params(module) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in module.named_parameters()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors), as fp32 on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().float().cpu().clone()


# ---- comparison and report -------------------------------------------------------------------------


def compare(name: str, whole_batch: dict, accumulated: dict, run: dict) -> dict:
    tol = TOLERANCES[name]
    loss_diffs = [abs(a - b) for a, b in zip(run["losses"], whole_batch["losses"])]
    grad_diffs = gradient_diffs(whole_batch["grads"], run["grads"])
    divergence = first_divergence(grad_diffs)
    update_diff = _relative_update_diff(run, whole_batch)
    initial_diff = _max_param_diff(run["initial"], whole_batch["initial"])
    bitwise = run["losses"] == accumulated["losses"] and _max_param_diff(run["final"], accumulated["final"]) == 0.0
    ok = (
        len(loss_diffs) == len(whole_batch["losses"])
        and initial_diff == 0.0
        and max(loss_diffs) <= tol.loss
        and divergence is None
        and update_diff <= tol.update
    )
    return {
        "ok": ok,
        "loss_diffs": loss_diffs,
        "max_loss_diff": max(loss_diffs),
        "max_param_diff": _max_param_diff(run["final"], whole_batch["final"]),
        "update_diff": update_diff,
        "max_gradient_diff": max((d["relative"] for step in grad_diffs for d in step.values()), default=0.0),
        "initial_param_diff": initial_diff,
        "loss_tolerance": tol.loss,
        "update_tolerance": tol.update,
        "bitwise_vs_accumulation": bitwise,
        "why": tol.why,
        "first_divergence": divergence,
    }


def _relative_update_diff(run: dict, reference: dict) -> float:
    """|final - reference final| / |reference final - initial|, both L2 over all parameters."""
    diff = sum(float((run["final"][n] - p).pow(2).sum()) for n, p in reference["final"].items())
    update = sum(float((p - reference["initial"][n]).pow(2).sum()) for n, p in reference["final"].items())
    return math.sqrt(diff / update) if update else (0.0 if diff == 0 else math.inf)


def gradient_diffs(reference: list[dict], run: list[dict]) -> list[dict[str, dict]]:
    """Per step, per parameter (model order): max abs gradient difference, and that as a fraction of the reference's largest element."""
    steps = []
    for ref_grads, grads in zip(reference, run):
        step = {}
        for name, ref in ref_grads.items():
            diff = _max_abs_diff(grads[name], ref) if name in grads else math.inf
            scale = float(ref.abs().max())
            step[name] = {"max_abs_diff": diff, "relative": diff / scale if scale else (0.0 if diff == 0 else math.inf)}
        steps.append(step)
    return steps


def first_divergence(diffs: list[dict[str, dict]]) -> dict | None:
    """At the first step where a gradient differs by more than GRAD_RTOL: the first such parameter
    in model order, and the one that differs most.

    A gradient-reduction bug shows as exactly the parameters it misses; a forward bug changes
    every gradient before it, and differs most near where it is.
    """
    for step, params in enumerate(diffs, start=1):
        diverged = [{"parameter": name, **d} for name, d in params.items() if d["relative"] > GRAD_RTOL]
        if diverged:
            largest = max(diverged, key=lambda d: d["relative"])
            return {"step": step, "first": diverged[0], "largest": largest, "count": len(diverged), "of": len(params)}
    return None


def _max_param_diff(params: dict, reference: dict) -> float:
    if params.keys() != reference.keys():
        return math.inf
    return max(_max_abs_diff(params[name], ref) for name, ref in reference.items())


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def print_report(config: str, results: dict, global_batch: int) -> None:
    steps = len(next(iter(results.values()))["loss_diffs"])
    print(f"\nparity of {config}: {steps} steps of global batch {global_batch}, fp32, against one process on the whole batch")
    print(
        "mesh: dp_replicate x dp_shard x tp. grad diff: max abs difference of a gradient over its largest element (any step; "
        f"tolerance {GRAD_RTOL:g}). update diff: |params - reference| / |reference update|, L2 over all parameters"
    )
    header = ["strategy", "processes", "mesh", "max |loss diff|", "tol", "max grad diff", "max |param diff|", "update diff", "tol", "bitwise vs accum.", "result"]
    rows = [header]
    for name, r in results.items():
        mesh = "x".join(str(size) for size in LAYOUTS[name][1].values())
        rows.append([
            name, str(LAYOUTS[name][0]), mesh, f"{r['max_loss_diff']:.2e}", f"{r['loss_tolerance']:.0e}",
            f"{r['max_gradient_diff']:.2e}", f"{r['max_param_diff']:.2e}", f"{r['update_diff']:.2e}", f"{r['update_tolerance']:.0e}",
            "yes" if r["bitwise_vs_accumulation"] else "no", "ok" if r["ok"] else "DIVERGED",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print("per-step |loss diff|:")
    for name, r in results.items():
        print(f"  {name:8s} " + "  ".join(f"{d:.2e}" for d in r["loss_diffs"]))
    for name, r in results.items():
        if r["ok"]:
            continue
        if r["initial_param_diff"]:
            print(f"{name}: the initial parameters already differ (by {r['initial_param_diff']:.3g}): the plan changed the weights")
        d = r["first_divergence"]
        if d is None:
            print(f"{name}: every gradient agrees within {GRAD_RTOL:g} of its scale; the difference comes from the optimizer step")
            continue
        first, largest = d["first"], d["largest"]
        print(
            f"{name}: gradients diverge at step {d['step']} in {d['count']} of {d['of']} parameters. First in model order: "
            f"{first['parameter']}, max abs diff {first['max_abs_diff']:.3g} ({first['relative']:.2%} of its largest element); "
            f"largest: {largest['parameter']} ({largest['relative']:.2%})"
        )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
