"""A strategy run against the references: losses, gradients, updates, initial weights, replicas and routing."""

from __future__ import annotations

import math

import torch

from uma_lightning.tools.parity.layouts import Tolerance


def compare(tol: Tolerance, whole_batch: dict, accumulated: dict, run: dict) -> dict:
    steps = len(whole_batch["losses"])
    loss_diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(run["losses"], whole_batch["losses"])]
    grad_diffs = gradient_diffs(whole_batch["grads"], run["grads"], tol.grad)
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


def gradient_diffs(reference: list[dict], run: list[dict], rtol: float) -> list[dict[str, dict]]:
    """Per step, per parameter (model order): max abs gradient difference, and that as a fraction of the
    reference's largest element. A gradient whose largest element is below ``rtol`` times the step's
    largest is rounding noise (e.g. an attention key's bias: softmax ignores a shift shared by a row
    of scores, so its true gradient is zero): it is measured against the step's largest instead."""
    steps = []
    for ref_grads, grads in zip(reference, run):
        step = {}
        largest = max((float(ref.abs().max()) for ref in ref_grads.values() if ref.numel()), default=0.0)
        for name, ref in ref_grads.items():
            diff = _max_abs_diff(grads[name], ref) if name in grads else math.inf
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            scale = scale if scale >= rtol * largest else largest
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
