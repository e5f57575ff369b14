"""Preemption: SIGTERM and SIGUSR1 save at the next step boundary and exit; Slurm's requeue is asked for;
a step that does not end within the grace period does not keep the job alive."""

import os
import signal
import stat
import time
from pathlib import Path

import pytest
import yaml

import forked_cli
from suite import RECIPE, TINY
from uma_lightning.checkpoint import committed, verify

# Every test starts a training process and signals it.
pytestmark = pytest.mark.slow

ARGS = ["--data.n_episodes", "6", "--data.batch_size", "16", "--data.num_workers", "0"]


def write_recipe(path: Path, max_steps: int, grace_period_s: float, extra_callbacks=()) -> str:
    recipe = {
        "include": [RECIPE],
        "model": {"init_args": {"size": TINY}},
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
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=12, grace_period_s=60)
    status, seconds, log = start_and_signal(tmp_path, recipe, "first", signal.SIGTERM, after_step=3)
    assert status == 128 + signal.SIGTERM, log[-3000:]
    assert "received SIGTERM: saving a checkpoint at the next step boundary" in log
    (step, checkpoint), = committed(tmp_path / "run" / "checkpoints")
    assert 3 <= step < 12 and verify(checkpoint) == []
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
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "pretrain", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=200, grace_period_s=60)
    status, _, log = start_and_signal(tmp_path, recipe, "slurm", signal.SIGUSR1, after_step=2, env=slurm)
    assert status == 128 + signal.SIGUSR1, log[-3000:]
    (step, checkpoint), = committed(tmp_path / "run" / "checkpoints")
    assert verify(checkpoint) == [] and f"SIGUSR1: checkpoint of step {step} committed" in log
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    assert "requeued Slurm job 4242" in log


def test_a_step_that_outlasts_the_grace_period_exits_without_saving(tmp_path):
    stall = {"class_path": "checkpoint_modules.StallAfter", "init_args": {"step": 3, "seconds": 60}}
    recipe = write_recipe(tmp_path / "recipe.yaml", max_steps=200, grace_period_s=1.0, extra_callbacks=[stall])
    status, seconds, log = start_and_signal(tmp_path, recipe, "stalled", signal.SIGTERM, after_step=3, wait_for="stalling after step 3")
    assert status == 128 + signal.SIGTERM, log[-3000:]
    assert seconds < 30  # the grace period (1 s), not the 60 s stall
    assert "SIGTERM: no step boundary within the 1 s grace period; exiting without a new checkpoint" in log
    assert committed(tmp_path / "run" / "checkpoints") == []
