"""Preemption: SIGTERM and SIGUSR1 save at the next step boundary and exit; Slurm's requeue is asked for;
a step that does not end within the grace period does not keep the job alive."""

import io
import logging
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import forked_cli
import pytest
import yaml
from checkpoint_helpers import assert_bitwise_equal, checkpoint_tensors
from checkpoint_modules import resume_recipe as deterministic_recipe
from suite import RECIPE, TINY, free_port

from uma_lightning.callbacks.preemption import Preemption
from uma_lightning.checkpoint import committed, verify

# Every test starts a training process and signals it.
pytestmark = pytest.mark.slow

ARGS = ["--data.generation.n_episodes", "6", "--data.batch_size", "16", "--data.loader.num_workers", "0"]


def write_recipe(path: Path, max_steps: int, grace_period_s: float, extra_callbacks=()) -> str:
    recipe = {
        "include": [RECIPE],
        "model": {"init_args": {"network": {"size": TINY}}},
        "trainer": {
            "logger": False,
            "max_steps": max_steps,
            "val_check_interval": 1000,
            "callbacks": [
                {"class_path": "uma_lightning.callbacks.ProgressLog", "init_args": {"every_n_steps": 1}},
                # Periodic saves far apart: a checkpoint can only come from the signal.
                {"class_path": "uma_lightning.callbacks.ShardedCheckpoint", "init_args": {"every_n_steps": 1000}},
                {"class_path": "uma_lightning.callbacks.Preemption", "init_args": {"grace_period_s": grace_period_s}},
                *extra_callbacks,
            ],
        },
    }
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def hold_at(step: int) -> dict:
    """Holds the run after ``step`` until a signal comes: a fast machine cannot finish it first."""
    return {"class_path": "faults.HoldUntilSignalled", "init_args": {"at_step": step}}


def start_and_signal(tmp_path: Path, recipe: str, name: str, signum: int, after_step: int, env=None, wait_for=None):
    """Start a run, send ``signum`` once it logged step ``after_step`` (or the line ``wait_for``);
    returns (exit status, seconds from signal to exit, log)."""
    log = tmp_path / f"{name}.log"
    argv = ["fit", "--config", recipe, *ARGS, "--trainer.default_root_dir", str(tmp_path / "run")]
    process = forked_cli.start(argv, log, tmp_path, env)
    deadline = time.monotonic() + 180
    while (wait_for or f"step {after_step}/") not in (log.read_text() if log.exists() else ""):
        assert process.is_alive() and time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.01)
    sent = time.monotonic()
    os.kill(process.pid, signum)
    process.join(120)
    return process.exitcode, time.monotonic() - sent, log.read_text()


def test_sigterm_saves_at_the_next_step_and_the_rerun_resumes_from_there(tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=12, grace_period_s=60, extra_callbacks=[hold_at(3)])
    # Signalled while held, not as soon as "step 3/" is logged: between that line and Preemption's hook of
    # step 3, the signal would be seen at step 3's boundary (seen once under four test workers on 2 cores).
    status, seconds, log = start_and_signal(
        tmp_path, recipe, "first", signal.SIGTERM, after_step=3, wait_for="HoldUntilSignalled: holding after step 3"
    )
    assert status == 128 + signal.SIGTERM, log[-3000:]
    assert "received SIGTERM: saving a checkpoint at the next step boundary" in log
    ((step, checkpoint),) = committed(tmp_path / "run" / "checkpoints")
    assert step == 4 and verify(checkpoint) == []  # held after step 3: saved at the next step
    assert f"SIGTERM: checkpoint of step {step} committed, exiting" in log
    assert seconds < 60

    argv = ["fit", "--config", recipe, *ARGS, "--trainer.default_root_dir", str(tmp_path / "run")]
    assert forked_cli.run(argv, tmp_path / "rerun.log", tmp_path, timeout=300) == 0
    rerun = (tmp_path / "rerun.log").read_text()
    assert f"resumed from {checkpoint}: step {step}" in rerun and f"trained {12 - step} steps" in rerun


def test_sigusr1_under_slurm_saves_and_requeues_the_job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records how it was called, as the real one would requeue
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "pretrain",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=200, grace_period_s=60)
    status, _, log = start_and_signal(tmp_path, recipe, "slurm", signal.SIGUSR1, after_step=2, env=slurm)
    assert status == 128 + signal.SIGUSR1, log[-3000:]
    ((step, checkpoint),) = committed(tmp_path / "run" / "checkpoints")
    assert verify(checkpoint) == [] and f"SIGUSR1: checkpoint of step {step} committed" in log
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    assert "requeued Slurm job 4242" in log


def test_a_step_that_outlasts_the_grace_period_exits_without_saving(tmp_path):
    stall = {"class_path": "checkpoint_modules.StallAfter", "init_args": {"step": 3, "seconds": 60}}
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=200, grace_period_s=1.0, extra_callbacks=[stall])
    status, seconds, log = start_and_signal(
        tmp_path, recipe, "stalled", signal.SIGTERM, after_step=3, wait_for="stalling after step 3"
    )
    assert status == 128 + signal.SIGTERM, log[-3000:]
    assert seconds < 30  # the grace period (1 s), not the 60 s stall
    assert "SIGTERM: no step boundary within the 1 s grace period; exiting without a new checkpoint" in log
    assert committed(tmp_path / "run" / "checkpoints") == []


def start_ranks(argv: list[str], logs: list[Path], cwd: Path, process_group: int | None = None) -> list:
    """One ``uma`` process, or two started as torchrun starts them (they join one gloo group)."""
    if len(logs) == 1:
        return [forked_cli.start(argv, logs[0], cwd, process_group=process_group)]
    port = str(free_port())
    return [
        forked_cli.start(
            argv,
            log,
            cwd,
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": "2",
                "NODE_RANK": "0",
                "LOCAL_RANK": str(rank),
            },
            process_group,
        )
        for rank, log in enumerate(logs)
    ]


def wait_for_step(processes: list, log: Path, step: int, timeout: float = 180) -> None:
    """Until rank zero (which alone prints progress) logged ``step``, while every rank is alive."""
    deadline = time.monotonic() + timeout
    while f"step {step}/" not in (log.read_text() if log.exists() else ""):
        assert all(p.is_alive() for p in processes) and time.monotonic() < deadline, (
            log.read_text()[-3000:] if log.exists() else "no log"
        )
        time.sleep(0.01)


GROUP_SIGNALS = {1: (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT), 2: (signal.SIGTERM, signal.SIGUSR1)}


@pytest.mark.parametrize("world_size", sorted(GROUP_SIGNALS))
@pytest.mark.slow(seconds=25)
def test_signals_to_the_whole_process_group_save_once_and_the_run_resumes_bit_for_bit(tmp_path, world_size):
    """As Slurm and a terminal do, the signal goes to every process of the group: the training processes
    and their train and validation loader workers. Only the training processes act; the workers live on
    until the save is committed. Each signal interrupts the run once more; the end matches an
    uninterrupted run bit for bit."""
    max_steps = 4 * len(GROUP_SIGNALS[world_size]) + 2
    callbacks = [
        {"class_path": "uma_lightning.callbacks.ProgressLog", "init_args": {"every_n_steps": 1}},
        {"class_path": "uma_lightning.callbacks.Preemption", "init_args": {"grace_period_s": 60}},
    ]
    parallel = {"strategy": "ddp", "accelerator": "cpu", "devices": 2} if world_size == 2 else {}
    recipe = deterministic_recipe(
        tmp_path / "recipe.yaml",
        tmp_path / "record",
        callbacks,
        every_n_steps=1000,
        trainer={**parallel, "max_steps": max_steps},
    )
    data = ["--data.generation.n_episodes", "6", "--data.batch_size", "16", "--data.loader.num_workers", "1"]
    if world_size == 2:  # workers from a forkserver (as with remote storage or CUDA), not forked
        data += ["--data.loader.multiprocessing_context", "forkserver"]

    def command(run_dir: Path, hold_at_step: int | None) -> list[str]:
        hold = (
            []
            if hold_at_step is None
            else ["--trainer.callbacks+=faults.HoldUntilSignalled", f"--trainer.callbacks.at_step={hold_at_step}"]
        )
        return ["fit", "--config", recipe, *data, "--trainer.default_root_dir", str(run_dir), *hold]

    def run(
        run_dir: Path, name: str, process_group: int | None = None, hold_at_step: int | None = None
    ) -> tuple[list, list[Path]]:
        logs = [tmp_path / f"{name}.rank{rank}.log" for rank in range(world_size)]
        return start_ranks(command(run_dir, hold_at_step), logs, tmp_path, process_group), logs

    reference, _ = run(tmp_path / "reference", "reference")
    for process in reference:
        process.join(300)
    assert [p.exitcode for p in reference] == [0] * world_size

    checkpoints = tmp_path / "run" / "checkpoints"
    for signum in GROUP_SIGNALS[world_size]:
        name = signal.Signals(signum).name
        start_step = max((step for step, _ in committed(checkpoints)), default=0)
        leader = subprocess.Popen(["sleep", "300"], process_group=0)  # the group's leader, as a job step's shell
        try:
            processes, logs = run(tmp_path / "run", name, leader.pid, hold_at_step=start_step + 2)
            wait_for_step(processes, logs[0], start_step + 2)
            os.killpg(leader.pid, signum)
            for process in processes:
                process.join(120)
        finally:
            leader.kill()
            leader.wait()
        texts = [log.read_text() for log in logs]
        assert [p.exitcode for p in processes] == [128 + signum] * world_size, texts[0][-3000:]
        (step, checkpoint), *_ = reversed(committed(checkpoints))
        # Held after start_step + 2; saved there when a rank was still short of the ranks' agreement, else at the next step.
        assert start_step + 2 <= step <= start_step + 3 and verify(checkpoint) == []
        for text in texts:  # one handler acted in each training process, none in a worker
            assert text.count(f"received {name}: saving a checkpoint") == 1, text[-3000:]
            assert text.count(f"{name}: checkpoint of step {step} committed, exiting with status {128 + signum}") == 1
            assert "Traceback" not in text and "DataLoader worker" not in text, text[-3000:]
        if start_step:
            assert f"resumed from {checkpoints / f'step-{start_step:09d}'}: step {start_step}" in texts[0]

    final, logs = run(tmp_path / "run", "final")
    for process in final:
        process.join(300)
    assert [p.exitcode for p in final] == [0] * world_size, logs[0].read_text()[-3000:]
    last = f"step-{max_steps:09d}"
    assert_bitwise_equal(
        checkpoint_tensors(checkpoints / last), checkpoint_tensors(tmp_path / "reference" / "checkpoints" / last)
    )


def test_an_mlflow_run_stopped_by_a_signal_is_killed_and_a_failing_store_does_not_break_teardown(
    tmp_path, caplog, monkeypatch
):
    from mlflow.exceptions import MlflowException

    from uma_lightning.callbacks.preemption import Preempted
    from uma_lightning.tracking.mlflow_logger import MLflowLogger

    logger = MLflowLogger(store_dir=str(tmp_path / "mlruns"), synchronous=True)
    run_id = logger.run_id
    try:  # as Lightning finalizes its loggers while the exception is raised
        raise Preempted(signal.SIGTERM, None, None)
    except SystemExit:
        logger.finalize("failed")
    assert logger.experiment.get_run(run_id).info.status == "KILLED"

    def unreachable(*args, **kwargs):
        raise MlflowException("API request failed: connection refused")

    monkeypatch.setattr(logger.experiment, "set_terminated", unreachable)
    try:
        raise Preempted(signal.SIGUSR1, None, None)
    except SystemExit:
        logger.finalize("failed")  # logs, does not raise
    assert f"could not mark MLflow run {run_id} as KILLED: API request failed: connection refused" in caplog.text
    with pytest.raises(MlflowException):  # a run that ends well still reports a store that fails
        logger.finalize("success")


def test_a_signal_that_interrupts_a_log_write_is_still_announced():
    """A handler run inside a write to the log's stream (a pipe's write retried after EINTR does that)
    must not write to the same stream itself: like Python's buffered writers, the stream here refuses
    a reentrant write, and the line would be lost to a logging error."""
    preemption = Preemption(grace_period_s=60)

    class Stream(io.StringIO):
        writing = False

        def write(self, text):
            if self.writing:
                raise RuntimeError("reentrant call inside the stream")
            self.writing = True
            try:
                if "step 3/" in text:
                    preemption._on_signal(signal.SIGTERM, None)  # the signal lands mid-write
                return super().write(text)
            finally:
                self.writing = False

    stream = Stream()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("uma_lightning")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("step 3/12 | loss 1.0")
        deadline = time.monotonic() + 10
        while "received SIGTERM" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        preemption._cancel_timer()
    assert "step 3/12" in stream.getvalue()
    assert "received SIGTERM: saving a checkpoint at the next step boundary" in stream.getvalue()
