"""SIGKILL a training job at a chosen moment, run the same command again, and compare where it ends
with an uninterrupted run, bit for bit: under any strategy preset (``configs/strategy``) and either
model stage (the pretrain recipe, the posttrain recipe with its flow expert).

A moment is a phase of one step on one rank:

- ``forward``: at the k-th module call of that step's forward pass;
- ``backward``: when the gradient reaches the output of that k-th module call;
- ``write``: at that rank's k-th write into the files of the step's checkpoint (a file left half
  written), or after its last where it makes fewer;
- ``commit``: on rank 0, which commits, just before (k = 0) or just after (k = 1) the checkpoint's
  rename into place (after: before older checkpoints are pruned).

``KillAt``, a callback given to the killed command only, makes the chosen rank SIGKILL itself there,
after writing what it was doing to ``killed.json``; the harness then SIGKILLs the other ranks, as a
job scheduler does once one process of a job is gone. The uninterrupted run of a (strategy, stage)
is the same command without ``KillAt``; it is cached in a folder the caller gives.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import forked_cli
import torch
from checkpoint_helpers import checkpoint_tensors
from checkpoint_modules import resume_recipe
from lightning.pytorch import Callback
from suite import REPO, recipe

from uma_lightning.checkpoint import committed, step_dirname, verify
from uma_lightning.checkpoint.directory import staging_path

# What draw_moments draws from; the harness runs pp_fsdp and pp_fsdp_tp too (pretraining, 4 processes).
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "pp", "ep", "ep_fsdp")
STAGES = ("pretrain", "posttrain")
PHASES = ("forward", "backward", "write", "commit")
# The flow model's action expert attends to every backbone layer's keys: it cannot be cut into stages
# (uma_lightning/parallel/plans/pipeline.py refuses it, under every pp preset).
UNSUPPORTED = {("pp", "posttrain")}
MAX_STEPS = 8
EVERY_N_STEPS = 2
CALLS = 24  # a forward, backward or write kill comes at one of the first this many module calls or writes

# Two layers (pp splits them), as many key/value heads as heads (tp splits both).
DENSE = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}
# ep and ep_fsdp split experts: the second layer is a mixture of four.
EXPERTS = {**DENSE, "n_kv_heads": 1, "moe": {"n_experts": 4, "top_k": 2, "n_shared": 1, "every_n_layers": 2, "expert_dim": 32}}  # fmt: skip
DATA = ["--data.generation.n_episodes", "6", "--data.batch_size", "4", "--data.loader.num_workers", "0"]
# Where a preset on one node of 4 processes would leave an axis of size 1, its own comment's sizes for 4.
# The pipeline presets that compose pp with another axis set their own sizes for 4.
FOUR_RANKS = {
    "hsdp": ["--trainer.strategy.init_args.sizes.dp_shard", "2"],
    "fsdp_tp": ["--trainer.strategy.init_args.sizes.tp", "2"],
    "ep_fsdp": ["--trainer.strategy.init_args.sizes.ep", "2"],
    "pp_fsdp": [],
    "pp_fsdp_tp": [],
}


def world_size(strategy: str) -> int:
    return 4 if strategy in FOUR_RANKS else 2


@dataclass(frozen=True)
class Moment:
    """Where to kill: ``phase`` of step ``step`` (1 is the first optimizer step; for write and commit,
    the checkpoint saved after it) on ``rank``; ``call`` is k above."""

    strategy: str
    stage: str
    phase: str
    step: int
    rank: int
    call: int

    def describe(self) -> str:
        where = {"forward": f"module call {self.call}", "backward": f"module call {self.call}", "write": f"write {self.call}",
                 "commit": "before the rename" if self.call == 0 else "after the rename"}[self.phase]  # fmt: skip
        return f"{self.phase} (rank {self.rank}, {where})"


def draw_moments(seed: int, count: int, cases: list[tuple[str, str]] | None = None) -> list[Moment]:
    """``count`` moments: every (strategy, stage) of ``cases`` (all supported ones by default) once in a
    shuffled order before any comes again, the phases taken in turn, step, rank and call drawn."""
    chooser = random.Random(seed)
    cases = cases or [(s, t) for s in STRATEGIES for t in STAGES if (s, t) not in UNSUPPORTED]
    order: list[tuple[str, str]] = []
    while len(order) < count:
        order += chooser.sample(cases, len(cases))
    phases = chooser.sample(PHASES, len(PHASES))
    moments = []
    for index, (strategy, stage) in enumerate(order[:count]):
        phase = phases[index % len(phases)]
        if phase in ("write", "commit"):
            step = chooser.choice(range(EVERY_N_STEPS, MAX_STEPS + 1, EVERY_N_STEPS))
        else:
            step = chooser.randint(1, MAX_STEPS)
        rank = 0 if phase == "commit" else chooser.randrange(world_size(strategy))
        call = chooser.randint(0, 1) if phase == "commit" else chooser.randint(1, CALLS)
        moments.append(Moment(strategy, stage, phase, step, rank, call))
    return moments


def _die(record: Path, moment: dict) -> None:
    """Write what this rank was doing, then SIGKILL this process: no handler, no cleanup runs."""
    record.write_text(json.dumps({**moment, "pid": os.getpid(), "time": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(Callback):
    """Makes rank ``rank`` SIGKILL itself at ``phase`` of step ``step`` (see the module docstring),
    once it has written ``record`` (a JSON of the moment)."""

    def __init__(self, phase: str, step: int, rank: int, call: int, record: str):
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        self.phase, self.step, self.rank, self.call, self.record = phase, step, rank, call, Path(record)
        self._hook = None
        self._calls = 0

    def _kill(self, what: str) -> None:
        _die(self.record, {"phase": self.phase, "step": self.step, "rank": self.rank, "call": self.call, "at": what})

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank != self.rank or self.phase not in ("write", "commit"):
            return
        # The checkpoint writer's own module globals, wrapped in this process only: the save of
        # step ``step`` is where the kill comes, on whichever thread writes it.
        from uma_lightning.checkpoint import writer

        staging, final = staging_path(Path(), self.step).name, step_dirname(self.step)
        if self.phase == "write":
            from uma_lightning.checkpoint import storage

            write, save_tensors = storage._ChecksummedFile.write, writer.save_tensors
            writes = 0

            def write_then_die(file, data):
                nonlocal writes
                written = write(file, data)
                path = Path(file._file.name)
                if path.parent.name == staging:
                    writes += 1
                    if writes == self.call:
                        self._kill(f"write: {writes} writes into the checkpoint's files, {path.name} still open")
                return written

            def save_then_die(tensors, directory, *args, **kwargs):  # fewer writes than drawn: after the last
                written = save_tensors(tensors, directory, *args, **kwargs)
                if Path(directory).name == staging:
                    self._kill(f"write: all {writes} writes into {', '.join(written)} done, no manifest yet")
                return written

            storage._ChecksummedFile.write, writer.save_tensors = write_then_die, save_then_die
        else:
            commit = writer.commit

            def commit_and_die(staging_dir, final_dir):
                if Path(final_dir).name == final and self.call == 0:
                    self._kill(f"commit: before renaming {staging_dir}")
                commit(staging_dir, final_dir)
                if Path(final_dir).name == final:
                    self._kill(f"commit: after renaming to {final_dir}")

            writer.commit = commit_and_die

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        armed = trainer.global_rank == self.rank and trainer.global_step == self.step - 1
        if armed and self.phase in ("forward", "backward"):
            self._calls = 0
            self._hook = torch.nn.modules.module.register_module_forward_hook(self._on_module_call)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _on_module_call(self, module, args, output) -> None:
        self._calls += 1
        if self._calls < self.call:
            return
        name = type(module).__name__
        if self.phase == "forward":
            self._kill(f"forward: call {self._calls} ({name})")
        first = next((t for t in (output if isinstance(output, (tuple, list)) else [output])
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)  # fmt: skip
        if first is not None:  # else the next call's output: one that a gradient will reach
            call = self._calls
            first.register_hook(lambda grad: self._kill(f"backward: the gradient of call {call} ({name})"))
            self._hook.remove()


def _model(stage: str, strategy: str) -> dict:
    size = EXPERTS if strategy.startswith("ep") else DENSE
    if stage == "pretrain":
        return {"class_path": "checkpoint_modules.NoisyPretrain", "init_args": {"network": {"size": size}}}
    return {
        "class_path": "uma_lightning.modules.PosttrainModule",
        "init_args": {"network": {"size": size}, "expert": {"dim": 32, "ffn_dim": 64}, "init_from": None},
    }


def command(strategy: str, stage: str, folder: Path) -> list[str]:
    """``uma fit`` of ``stage`` under the ``strategy`` preset, its recipe and run in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    trainer = {"accelerator": "cpu", "devices": world_size(strategy), "max_steps": MAX_STEPS, "limit_val_batches": 0}
    recipe_file = resume_recipe(
        folder / "recipe.yaml",
        folder / "record",
        every_n_steps=EVERY_N_STEPS,
        trainer=trainer,
        base=recipe(stage),
        model=_model(stage, strategy),
    )
    preset = str(REPO / "configs" / "strategy" / f"{strategy}.yaml")
    return ["fit", "--config", recipe_file, "--config", preset, *FOUR_RANKS.get(strategy, []), *DATA,
            "--trainer.default_root_dir", str(folder / "run")]  # fmt: skip


def _final(folder: Path) -> Path:
    return folder / "run" / "checkpoints" / step_dirname(MAX_STEPS)


def _run(argv: list[str], log: Path, cwd: Path, ranks: int) -> None:
    statuses = forked_cli.run_as_ranks(argv, log, cwd, world_size=ranks, timeout=600)
    if statuses != [0] * ranks:
        raise RuntimeError(f"exit statuses {statuses}: uma {' '.join(argv)}\n{log.read_text()[-3000:]}")


def reference(strategy: str, stage: str, cache: Path) -> Path:
    """The final checkpoint of the uninterrupted run, trained once per (strategy, stage) and command
    into ``cache`` (a changed command trains it again)."""
    folder = cache / f"{strategy}-{stage}"
    argv = command(strategy, stage, folder)
    key = folder / "command.json"
    if _final(folder).is_dir() and key.exists() and json.loads(key.read_text()) == argv and not verify(_final(folder)):
        return _final(folder)
    shutil.rmtree(folder / "run", ignore_errors=True)
    key.unlink(missing_ok=True)
    _run(argv, folder / "reference.log", folder, world_size(strategy))
    key.write_text(json.dumps(argv))
    return _final(folder)


def different_tensors(checkpoint: Path, expected: Path) -> list[str]:
    """The model and optimizer tensors of ``checkpoint`` that are not bit for bit those of ``expected``
    (or that only one of them holds)."""
    actual, wanted = checkpoint_tensors(checkpoint), checkpoint_tensors(expected)
    return sorted(set(actual) ^ set(wanted)) + [
        key for key in wanted if key in actual and not torch.equal(actual[key], wanted[key])
    ]


@dataclass
class Outcome:
    moment: Moment
    killed_at: str  # what the killed rank was doing, from its record
    newest_before_rerun: int  # the newest committed checkpoint's step after the kill (0: none)
    resumed_as_expected: bool  # the rerun resumed from that checkpoint (or said there was nothing to train)
    different: list[str]  # the tensors (model and optimizer) that differ from the uninterrupted run's
    seconds: float  # the killed run and the rerun

    @property
    def bitwise(self) -> bool:
        return not self.different

    def to_json(self) -> dict:
        return {**asdict(self), "bitwise": self.bitwise}


def kill_and_rerun(moment: Moment, folder: Path, reference_checkpoint: Path, timeout: float = 600) -> Outcome:
    """Start the command, let ``KillAt`` kill its rank at ``moment``, SIGKILL the others, check every
    committed checkpoint verifies, run the command again and compare its final checkpoint with
    ``reference_checkpoint``. Raises when the kill did not happen (the run ended or failed first)."""
    began = time.monotonic()
    argv = command(moment.strategy, moment.stage, folder)
    record = folder / "killed.json"
    kill = ["--trainer.callbacks+=kill_and_rerun.KillAt", f"--trainer.callbacks.phase={moment.phase}",
            f"--trainer.callbacks.step={moment.step}", f"--trainer.callbacks.rank={moment.rank}",
            f"--trainer.callbacks.call={moment.call}", f"--trainer.callbacks.record={record}"]  # fmt: skip
    ranks = forked_cli.start_ranks(argv + kill, folder / "killed.log", folder, world_size(moment.strategy))
    deadline = time.monotonic() + timeout
    while all(rank.is_alive() for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    for rank in ranks:  # what a scheduler does to a job one of whose processes died
        rank.kill()
        rank.join()
    logs = "".join(forked_cli.rank_log(folder / "killed.log", r).read_text() for r in range(len(ranks)))
    if not record.exists() or ranks[moment.rank].exitcode != -signal.SIGKILL:
        raise RuntimeError(f"not killed at step {moment.step}, {moment.describe()}: exit statuses {[r.exitcode for r in ranks]}\n{logs[-3000:]}")  # fmt: skip
    checkpoints = folder / "run" / "checkpoints"
    corrupt = [str(path) for _, path in committed(checkpoints) if verify(path)]
    if corrupt:
        raise RuntimeError(f"a committed checkpoint does not verify after the kill: {corrupt}")
    newest = max([step for step, _ in committed(checkpoints)], default=0)

    _run(argv, folder / "rerun.log", folder, world_size(moment.strategy))
    log = (folder / "rerun.log").read_text()
    if newest == MAX_STEPS:
        expected = f"this run already reached max_steps {MAX_STEPS} ({step_dirname(MAX_STEPS)})"
    elif newest:
        expected = f"resumed from {checkpoints / step_dirname(newest)}: step {newest}"
    else:
        expected = None
    resumed = expected in log if expected else "resumed from" not in log
    different = different_tensors(_final(folder), reference_checkpoint)
    killed_at = json.loads(record.read_text())["at"]
    return Outcome(moment, killed_at, newest, resumed, different, round(time.monotonic() - began, 1))
