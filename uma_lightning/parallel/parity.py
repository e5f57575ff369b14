"""``uma parity``: does a recipe train the same under each strategy as on one process?

    uma parity --config recipes/pretrain.yaml --strategies ddp,fsdp,tp --steps 4 [recipe overrides...]
    uma parity --config recipes/pretrain.yaml --precision bf16-mixed [--strategies fsdp] [recipe overrides...]

The recipe's model and data are resolved as ``uma fit`` would, and the first ``--steps`` batches
of its training data become the global batches. Each strategy trains on them in a group of gloo
processes on this machine (2, or 4 for the meshes hsdp, fsdp_tp, pp_fsdp, pp_fsdp_tp and ep_fsdp), each data-parallel rank
on its equal slice of every global batch, from the same initial weights as the references:

- one process on each whole global batch: the comparison that matters, judged against the
  tolerances in ``TOLERANCES``;
- one process accumulating gradients over the same slices, in rank order: strategies whose
  reductions add two numbers (``Tolerance.bitwise``) must match it bit for bit.

Two choices keep a correct strategy from ever looking wrong:

- every run is in float64, where reordering a sum moves it by ~1e-16 of its size, while a real
  bug moves gradients by ~1e-3: the tolerances sit many decades from both;
- each step of a strategy run starts from the reference's weights after the step before, so a
  difference cannot compound through the optimizer (AdamW divides each gradient element by its
  running size, which magnifies rounding noise of near-zero gradients step after step).

The verdict also checks that the initial weights equal the reference's, that every rank holds
the same copy of every replicated weight, and, for mixture-of-experts models, that every step
routes exactly as many tokens to each expert of each layer as one process does. For a strategy that fails, the report names the
first parameter in model order where the run parts ways: in the initial weights, between the
ranks, or in the gradients of the first step that differs (with the one that differs most).

``--precision bf16-mixed`` or ``16-mixed`` (``precision_parity.py``) compares that precision with
fp32 instead, layer by layer, on one process or under one strategy.

Recipe keys are overridden as in ``uma fit`` (``--model.network.size ...``). Keep the model small: the
tool holds every step's full gradients and weights in memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.plugins.precision import DoublePrecision

from uma_lightning.cli_errors import ConfigError
from uma_lightning.models.moe import moe_layers
from uma_lightning.parallel.launch import run_local_group
from uma_lightning.parallel.mesh import MESH_DIMS
from uma_lightning.parallel.precision_parity import compare_precision, print_precision_report
from uma_lightning.parallel.recorded_runs import COMPARE_DTYPE, train, worker

log = logging.getLogger("uma_lightning")

PRECISIONS = ("bf16-mixed", "16-mixed")
# Trainer arguments for float64 runs. As a plugin, not precision="64-true": Lightning refuses that
# flag with ModelParallelStrategy, whose parallelisms (DTensor, FSDP2, gloo) all handle float64.
FLOAT64 = {"plugins": [DoublePrecision()]}


@dataclass(frozen=True)
class Tolerance:
    loss: float  # max over steps of |loss - reference loss| / max(1, |reference loss|)
    grad: float  # max abs gradient difference / the reference gradient's largest element, per parameter and step
    update: float  # per step: |params - reference params| / |reference update of that step| (L2 over all parameters)
    bitwise: bool  # must equal the rank-ordered accumulation bit for bit
    why: str


# How far a correct strategy may be from one process, from the dtype and the sizes of the sums
# it reorders. A sum of n terms evaluated in another order moves by at most ~n * eps of the sum
# of their magnitudes (by ~sqrt(n) * eps in practice, the roundings having random signs). The
# longest sums a strategy reorders are a weight gradient's sum over the global batch's tokens
# and, under tensor parallelism, the partial products of the row-wise matmuls; for the models
# this tool can hold both stay under REDUCTION_TERMS. Gradients are judged against their largest
# element, so cancellation inside a sum counts against the margin: REDUCTION_TERMS * eps, 2.2e-11
# in float64, sits about four decades above the differences measured (a 3-layer, width-128 model
# under ddp, fsdp and tp: 2.4e-15 of a gradient's scale, 1.7e-16 of the loss) and eight below a
# real bug's (1e-3 and more). benchmarks/parity_sweep.py measures the margin on random shapes.
EPS = torch.finfo(COMPARE_DTYPE).eps
REDUCTION_TERMS = 1e5
SUM_TOLERANCE = REDUCTION_TERMS * EPS
# One AdamW step from the same weights: the update of an element is m / (sqrt(v) + eps_adam), whose
# slope in the gradient is at most 1 / eps_adam (1e8) where the gradient is near zero. Such elements
# are few, so in L2 over all parameters the update moves by far less; ADAM_GAIN bounds that gain
# (measured on the model above: 5e-14 against gradients' 2.4e-15, a gain near 20).
ADAM_GAIN = 1e3


def _tolerance(bitwise: bool, why: str) -> Tolerance:
    return Tolerance(loss=SUM_TOLERANCE, grad=SUM_TOLERANCE, update=SUM_TOLERANCE * ADAM_GAIN, bitwise=bitwise, why=why)


TOLERANCES = {
    "ddp": _tolerance(
        True,
        "each rank sums over its half of the batch inside the matmuls and the all-reduce adds the halves; one process "
        "sums over the whole batch in one matmul, and addition is not associative. Against one process that "
        "accumulates the same halves in rank order, DDP is bitwise identical: adding two numbers is exact to reorder",
    ),
    "fsdp": _tolerance(
        False,
        "as ddp for the gradients (the reduce-scatter adds the two halves). Not bitwise against accumulation: the "
        "clipping norm is summed from per-shard norms",
    ),
    "tp": _tolerance(
        False,
        "row-wise layers add partial matmul products across ranks, in the forward and the backward: every layer "
        "reorders sums, not just the final gradient reduction",
    ),
    "hsdp": _tolerance(
        False, "as fsdp, with four ranks' gradients summed in two stages (within, then across replicas)"
    ),
    "fsdp_tp": _tolerance(False, "the tp and fsdp reorderings together"),
    "pp": _tolerance(
        False,
        "each stage's gradients are summed over microbatches (as gradient accumulation sums them) and divided by their "
        "number after; the clipping norm adds the stages' squared norms",
    ),
    "pp_fsdp": _tolerance(False, "the pp and fsdp reorderings together"),
    "pp_fsdp_tp": _tolerance(False, "the pp and tp reorderings together (fsdp too where the processes allow it)"),
    "ep": _tolerance(
        False,
        "as ddp for the other parameters. An expert's owner sums the gradient over both ranks' tokens in one matmul, "
        "where the accumulating reference adds two per-slice sums",
    ),
    "ep_fsdp": _tolerance(
        False, "the ep reordering, with the dense and the expert gradients summed by reduce-scatters"
    ),
}

# Processes and mesh per strategy: the 2-D meshes use two ranks in each dimension so both are real.
LAYOUTS = {
    "ddp": (2, {"dp_replicate": 2, "dp_shard": 1, "tp": 1}),
    "fsdp": (2, {"dp_replicate": 1, "dp_shard": 2, "tp": 1}),
    "tp": (2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2}),
    "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2, "tp": 1}),
    "fsdp_tp": (4, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}),
    "pp": (2, {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}),
    "pp_fsdp": (4, {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}),
    # On four processes the FSDP dimension has one rank: tp and pp are what it checks together.
    "pp_fsdp_tp": (4, {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2}),
    # Experts split over 2 ranks: all of them under ep (the rest DDP); under ep_fsdp each rank's
    # experts are FSDP-sharded over 2 more, as the dense layers are over all 4.
    "ep": (2, {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "ep": 2}),
    "ep_fsdp": (4, {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 2}),
}


def needs_experts(name: str) -> bool:
    """Whether the strategy splits experts (ep above one), which refuses a model without mixture-of-experts layers."""
    return LAYOUTS[name][1].get("ep", 1) > 1


def data_parallel_size(name: str) -> int:
    sizes = LAYOUTS[name][1]
    return sizes["dp_replicate"] * sizes["dp_shard"]


@dataclass
class Case:
    """One model on its global batches, checked under ``strategies``."""

    label: str
    module: object  # the unconfigured LightningModule
    batches: list[dict]
    strategies: list[str]
    trainer_args: dict = field(default_factory=dict)  # gradient clipping, as the recipe sets it
    strategy_args: dict = field(
        default_factory=dict
    )  # MeshStrategy switches (activation checkpointing, compile...) of the strategy runs


def random_network(seed: int) -> list[str]:
    """Recipe overrides for a model shape drawn from ``seed``: layers, width, heads, kv heads,
    feed-forward width, vision tokenizer and environment-state head, all that tp 2 can split."""
    import random

    rng = random.Random(seed)
    n_kv_heads = rng.choice([2, 4])
    n_heads = n_kv_heads * rng.choice([1, 2])
    dim = n_heads * rng.choice([8, 16])
    size = {
        "name": "tiny",
        "n_layers": rng.randint(1, 3),
        "dim": dim,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "ffn_dim": 2 * rng.randint(dim // 4, dim),
    }
    vision = rng.choice(
        [
            {"tokenizer": "patches"},
            {"tokenizer": "keypoints", "n_keypoints": rng.choice([4, 8]), "channels": 8, "film": rng.random() < 0.5},
        ]
    )
    overrides = ["--model.network.size", json.dumps(size), "--model.network.vision", json.dumps(vision)]
    return overrides + ["--model.network.environment_state_weight", rng.choice(["0", "0.5"])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="uma parity",
        description="Does a recipe train the same under each strategy as on one process (or in low precision as in fp32)?",
        epilog="Other arguments override recipe keys, as in uma fit (e.g. --model.network.size tiny --data.batch_size 8).",
    )
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument(
        "--strategies",
        help=f"comma-separated, from {', '.join(LAYOUTS)} (default ddp,fsdp,tp; with --precision: one process)",
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="training steps, one global batch (data.batch_size samples) each"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="compare this precision with fp32, layer by layer, instead of strategies",
    )
    parser.add_argument(
        "--activation-checkpointing", default="none", choices=("none", "full", "ops"), help="in the strategy runs"
    )
    parser.add_argument("--ac-every-n-blocks", type=int, default=1)
    parser.add_argument("--compile", default="none", choices=("none", "blocks"), help="in the strategy runs")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP, in the strategy runs",
    )
    parser.add_argument("--cpu-offload", action="store_true", help="FSDP, in the strategy runs")
    parser.add_argument("--pp-schedule", default="1F1B", help="pipeline schedule, in the pp strategy runs")
    parser.add_argument("--pp-microbatches", type=int, help="pipeline microbatches (default: one per stage)")
    parser.add_argument("--pp-virtual-stages", type=int, default=1, help="pipeline stages per rank")
    parser.add_argument("--report", help="also write the results as JSON to this file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a group of processes may take")
    args, overrides = parser.parse_known_args(argv)
    default = "" if args.precision else "ddp,fsdp,tp"
    strategies = [
        s.strip() for s in (args.strategies if args.strategies is not None else default).split(",") if s.strip()
    ]
    try:
        unknown = [s for s in strategies if s not in LAYOUTS]
        if unknown or not (strategies or args.precision):
            raise ConfigError(
                f"--strategies: unknown strategy {', '.join(unknown) or '(none given)'}; choose from {', '.join(LAYOUTS)}"
            )
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        module, batches, trainer_args = resolve(args.config, overrides, args.steps)
        check_batch_splits(len(batches[0]["sample_id"]), strategies, args.pp_microbatches)
        check_experts(module, strategies)
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
        **(
            {
                "pp_schedule": args.pp_schedule,
                "pp_microbatches": args.pp_microbatches,
                "pp_virtual_stages": args.pp_virtual_stages,
            }
            if any(LAYOUTS[s][1].get("pp", 1) > 1 for s in strategies)
            else {}
        ),
    }
    global_batch = len(batches[0]["sample_id"])
    if args.precision:
        results = {name or "one process": compare_precision(module, batches, trainer_args, args.precision, name and LAYOUTS[name], strategy_args, args.timeout)
                   for name in strategies or [None]}  # fmt: skip
        print_precision_report(args.config, args.precision, results, global_batch)
        ok = all(r["ok"] for r in results.values())
    else:
        case = Case(args.config, module, batches, strategies, trainer_args, strategy_args)
        results = check_parity([case], args.timeout)[args.config]
        print_report(args.config, results, global_batch)
        ok = all(r["ok"] for r in results.values())
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


def check_batch_splits(global_batch: int, strategies: list[str], pp_microbatches: int | None = None) -> None:
    for name in strategies:
        stages = LAYOUTS[name][1].get("pp", 1)
        parts = data_parallel_size(name) * (pp_microbatches or stages if stages > 1 else 1)
        if global_batch % parts:
            raise ConfigError(
                f"{name}: global batch {global_batch} (data.batch_size) does not split over {data_parallel_size(name)} data-parallel ranks"
                + (f" x {parts // data_parallel_size(name)} pipeline microbatches" if stages > 1 else "")
            )


def check_experts(module, strategies: list[str]) -> None:
    """The expert-parallel strategies need mixture-of-experts layers; the model is built on the meta device to look."""
    wanting = [name for name in strategies if needs_experts(name)]
    if wanting:
        with torch.device("meta"):
            model = module.build_model()
        if not moe_layers(model):
            raise ConfigError(
                f"{', '.join(wanting)}: the model has no mixture-of-experts layers to split (use a size with a moe: section, e.g. --model.network.size tiny_moe)"
            )


def resolve(config: str, overrides: list[str], steps: int):
    """The recipe's (not yet configured) LightningModule, its first ``steps`` training batches, and its gradient clipping."""
    from uma_lightning.cli import resolve_recipe

    cli = resolve_recipe(config, overrides)
    cli.datamodule.setup("fit")
    batches = []
    for batch in cli.datamodule.train_dataloader():
        batches.append(batch)
        if len(batches) == steps:
            break
    if len(batches) < steps:
        raise ConfigError(f"{config}: the training data has only {len(batches)} batches, fewer than --steps {steps}")
    trainer_args = {
        "gradient_clip_val": cli.trainer.gradient_clip_val,
        "gradient_clip_algorithm": cli.trainer.gradient_clip_algorithm,
    }
    return cli.model, batches, trainer_args


def check_parity(cases: list[Case], timeout: float = 600) -> dict[str, dict[str, dict]]:
    """Train every case on one process and under each of its strategies; results per case label and strategy.

    All cases share the process groups: one launch per world size trains every case's strategies of that size.
    """
    with tempfile.TemporaryDirectory(prefix="uma-parity-") as tmp:
        work = Path(tmp)
        references, jobs = {}, []
        for index, case in enumerate(cases):
            log.info(
                "parity %s: %d steps of global batch %d; references on one process",
                case.label,
                len(case.batches),
                len(case.batches[0]["sample_id"]),
            )
            job = {
                "module": case.module,
                "batches": case.batches,
                "trainer_args": {**case.trainer_args, **FLOAT64},
                "strategy_args": case.strategy_args,
            }
            whole = train(job, None, work / f"{index}-reference.pt")
            # The accumulating references follow the whole-batch run's weights, as the strategies do
            # (one slice: the whole-batch run itself).
            job["trajectory"] = whole["params"]
            accumulated = {
                dp: train(job, None, work / f"{index}-accumulated{dp}.pt", micro_batches=dp) if dp > 1 else whole
                for dp in sorted({*map(data_parallel_size, case.strategies)})
            }
            references[case.label] = (whole, accumulated)
            jobs.append((index, job))
        results: dict[str, dict[str, dict]] = {case.label: {} for case in cases}
        for world_size in sorted({LAYOUTS[name][0] for case in cases for name in case.strategies}):
            runs = [
                (
                    job,
                    [
                        {"name": n, "sizes": LAYOUTS[n][1], "out": str(work / f"{index}-{n}.pt")}
                        for n in cases[index].strategies
                        if LAYOUTS[n][0] == world_size
                    ],
                )
                for index, job in jobs
            ]
            runs = [(job, strategies) for job, strategies in runs if strategies]
            log.info("parity: %d run(s) on %d processes", sum(len(s) for _, s in runs), world_size)
            # Through a file: passed as arguments, each tensor would take a file descriptor, and a
            # process may be handed only a few hundred. The runs hold modules, which torch.load's
            # weights-only unpickler refuses: plain pickle, in this process's private folder (mode 0700).
            with open(work / "runs.pickle", "wb") as f:
                pickle.dump(runs, f)
            run_local_group(worker, world_size, (str(work / "runs.pickle"),), timeout)
            for index, case in enumerate(cases):
                for name in case.strategies:
                    if LAYOUTS[name][0] == world_size:
                        whole, accumulated = references[case.label]
                        run = torch.load(work / f"{index}-{name}.pt", weights_only=True)
                        results[case.label][name] = compare(
                            TOLERANCES[name], whole, accumulated[data_parallel_size(name)], run
                        )
    return results


# ---- comparison and report -------------------------------------------------------------------------


def compare(tol: Tolerance, whole_batch: dict, accumulated: dict, run: dict) -> dict:
    steps = len(whole_batch["losses"])
    loss_diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(run["losses"], whole_batch["losses"])]
    grad_diffs = gradient_diffs(whole_batch["grads"], run["grads"])
    divergence = first_divergence(grad_diffs, tol.grad)
    update_diffs = [
        _relative_update_diff(run["params"][k], whole_batch["params"][k], whole_batch["params"][k - 1])
        for k in range(1, steps + 1)
    ]
    initial = first_difference(run["params"][0], whole_batch["params"][0])
    replicas = next(({"parameter": n, "max_abs_diff": d} for n, d in run["replica_spread"].items() if d), None)
    routing = first_routing_difference(whole_batch, run)
    bitwise = (
        run["losses"] == accumulated["losses"]
        and all(_same(a, b) for a, b in zip(run["grads"], accumulated["grads"]))
        and all(_same(a, b) for a, b in zip(run["params"], accumulated["params"]))
    )
    max_grad_diff = max((d["relative"] for step in grad_diffs for d in step.values()), default=0.0)
    measured = {"loss": max(loss_diffs, default=0.0), "grad": max_grad_diff, "update": max(update_diffs, default=0.0)}
    ok = (
        len(run["losses"]) == steps
        and initial is None
        and replicas is None
        and routing is None
        and all(measured[k] <= getattr(tol, k) for k in measured)
        and divergence is None
        and (bitwise or not tol.bitwise)
    )
    margins = {k: (getattr(tol, k) / v if v else math.inf) for k, v in measured.items()}
    return {
        "ok": ok,
        "loss_diffs": loss_diffs,
        "max_loss_diff": measured["loss"],
        "update_diffs": update_diffs,
        "update_diff": measured["update"],
        "max_gradient_diff": max_grad_diff,
        "max_param_diff": max(_max_param_diff(r, w) for r, w in zip(run["params"], whole_batch["params"])),
        "initial_param_diff": _max_param_diff(run["params"][0], whole_batch["params"][0]),
        "initial_difference": initial,
        "replica_difference": replicas,
        "routing_difference": routing,
        "loss_tolerance": tol.loss,
        "gradient_tolerance": tol.grad,
        "update_tolerance": tol.update,
        "margin": min(margins.values()),  # how many times the largest difference fits in its tolerance
        "bitwise_vs_accumulation": bitwise,
        "bitwise_required": tol.bitwise,
        "why": tol.why,
        "first_divergence": divergence,
        "parts_ways_at": parting_parameter(initial, replicas, divergence),
    }


def first_routing_difference(reference: dict, run: dict) -> dict | None:
    """The first step and mixture-of-experts layer where the run sent other numbers of tokens to
    the experts than the reference (counts summed over ranks), or left another balancing bias after
    the step, with both values; None if none. A layer the run did not report on differs too."""
    steps = zip(reference["routing"], run["routing"], reference["expert_biases"], run["expert_biases"])
    for step, (expected, counts, expected_biases, biases) in enumerate(steps, start=1):
        for what, values, wanted in (
            ("tokens per expert", counts, expected),
            ("balancing bias", biases, expected_biases),
        ):
            for layer, want in wanted.items():
                got = values.get(layer)
                if got is None or not torch.equal(want, got):
                    return {
                        "step": step,
                        "layer": layer,
                        "what": what,
                        "expected": want.tolist(),
                        "got": None if got is None else got.tolist(),
                    }
    if len(reference["routing"]) != len(run["routing"]):
        return {
            "step": min(len(reference["routing"]), len(run["routing"])) + 1,
            "layer": None,
            "what": "steps",
            "expected": None,
            "got": None,
        }
    return None


def parting_parameter(initial: dict | None, replicas: dict | None, divergence: dict | None) -> str | None:
    """The parameter where a run first parts ways with the reference: in its initial weights, between its ranks, or in a gradient."""
    for found in (initial, replicas, divergence and divergence["first"]):
        if found:
            return found["parameter"]
    return None


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _relative_update_diff(params: dict, reference: dict, start: dict) -> float:
    """|params - reference| / |reference - start|, both L2 over all parameters."""
    if params.keys() != reference.keys():
        return math.inf
    diff = sum(float((params[n] - p).pow(2).sum()) for n, p in reference.items())
    update = sum(float((p - start[n]).pow(2).sum()) for n, p in reference.items())
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


def first_divergence(diffs: list[dict[str, dict]], rtol: float) -> dict | None:
    """At the first step where a gradient differs by more than ``rtol`` of its scale: the first such
    parameter in model order, and the one that differs most.

    A gradient-reduction bug shows as exactly the parameters it misses; a forward bug changes
    every gradient before it, and differs most near where it is.
    """
    for step, params in enumerate(diffs, start=1):
        diverged = [{"parameter": name, **d} for name, d in params.items() if d["relative"] > rtol]
        if diverged:
            largest = max(diverged, key=lambda d: d["relative"])
            return {"step": step, "first": diverged[0], "largest": largest, "count": len(diverged), "of": len(params)}
    return None


def first_difference(params: dict, reference: dict) -> dict | None:
    """The first parameter in model order whose values differ from the reference's (or that is missing)."""
    for name, ref in reference.items():
        diff = _max_abs_diff(params[name], ref) if name in params else math.inf
        if diff:
            return {"parameter": name, "max_abs_diff": diff}
    return None


def _max_param_diff(params: dict, reference: dict) -> float:
    if params.keys() != reference.keys():
        return math.inf
    return max((_max_abs_diff(params[name], ref) for name, ref in reference.items()), default=0.0)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


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
        mesh = "x".join(str(LAYOUTS[name][1].get(dim, 1)) for dim in MESH_DIMS)
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
