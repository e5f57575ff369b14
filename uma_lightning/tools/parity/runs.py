"""Training a case on one process and under each strategy, and comparing the records."""

from __future__ import annotations

import json
import logging
import pickle
import re
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from uma_lightning.cli_errors import ConfigError
from uma_lightning.tools.launch import run_local_group
from uma_lightning.tools.parity.compare import compare
from uma_lightning.tools.parity.layouts import FLOAT64, LAYOUTS, TOLERANCES, data_parallel_size
from uma_lightning.tools.parity.recorded_runs import train, worker

log = logging.getLogger("uma_lightning")


@dataclass
class Case:
    """One model on its global batches, checked under ``strategies``."""

    label: str
    module: object  # the unconfigured LightningModule
    batches: list[dict]
    strategies: list[str]
    trainer_args: dict = field(default_factory=dict)  # gradient clipping, as the recipe sets it
    # MeshStrategy's sections besides the sizes ({"wrapping": ParallelConfig(...), "pipeline": ...}) in the strategy runs.
    strategy_args: dict = field(default_factory=dict)


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
            whole = reference_in_float64(case, job, work / f"{index}-reference.pt")
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


def reference_in_float64(case: Case, job: dict, out: Path) -> dict:
    """The one-process reference on whole batches; a network that cannot run in float64 (where
    every run of the check is) is a one-line ConfigError saying where it failed and why."""
    try:
        return train(job, None, out)
    except RuntimeError as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not (re.search(r"(?i)type", message) and re.search(r"(?i)float|double|half", message)):
            raise
        frames = [
            frame
            for frame in traceback.extract_tb(err.__traceback__)
            if not re.search(r"[/\\](torch|lightning|uma_lightning)[/\\]", frame.filename)
        ]
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        raise ConfigError(
            f"{case.label}: {type(case.module).__name__} cannot run in float64, which parity trains every run in: "
            f"{message}{where}; a tensor was cast to another float type (.float(), .half()): cast to the parameters' dtype instead"
        ) from None


# ---- comparison and report -------------------------------------------------------------------------
