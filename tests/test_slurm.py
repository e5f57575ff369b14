"""Preemption under a real one-node Slurm: the job template, the pretrain recipe with its loader worker
(a tiny model), preempted the two ways Slurm does it, ends COMPLETED after one restart, in one log."""

import time
from pathlib import Path

import pytest
import yaml
from slurm_cluster import SlurmCluster, SlurmUnavailable
from suite import RECIPE, TINY

from uma_lightning.checkpoint import committed, verify

TEMPLATE = Path(RECIPE).parents[1] / "configs" / "launch" / "slurm.sbatch"
TESTS = Path(__file__).parent  # for the jobs to import faults.HoldUntilSignalled
MAX_STEPS = 40
PREEMPT_AT_STEP = 10  # the job holds there until its signal comes: a fast job once finished before it
CPU_NODE = ["--nodes", "1", "--ntasks-per-node", "1", "--gpus-per-node", "0", "--cpus-per-task", "1", "--time", "20:00"]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as err:
        pytest.skip(f"no Slurm cluster: {err}")
    yield cluster
    cluster.stop()


def preempt(cluster: SlurmCluster, job: str, name: str) -> None:
    if name == "SIGUSR1":  # what --signal=USR1@120 sends before the time limit; the job requeues itself
        cluster.run("scancel", "--signal=USR1", job)
    else:  # preemption: SIGTERM to every process of the job, which Slurm then requeues
        cluster.run("scancel", "--signal=TERM", job)
        cluster.run("scontrol", "requeue", job)


@pytest.mark.slow(seconds=40)
@pytest.mark.timeout(900)
def test_preempted_jobs_save_requeue_resume_and_complete(slurm, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"include": [RECIPE], "model": {"init_args": {"network": {"size": TINY}}}}))
    jobs = {}
    for name in ("SIGUSR1", "SIGTERM"):  # both at once, one CPU each
        job_dir = tmp_path / name
        job_dir.mkdir()
        args = [
            "--config",
            str(recipe),
            "--data.generation.n_episodes",
            "6",
            "--data.batch_size",
            "16",
            "--trainer.max_steps",
            str(MAX_STEPS),
            "--trainer.default_root_dir",
            str(job_dir / "run"),
            "--trainer.callbacks+=faults.HoldUntilSignalled",
            f"--trainer.callbacks.at_step={PREEMPT_AT_STEP}",
        ]
        export = f"--export=ALL,PYTHONPATH={TESTS}"
        job = slurm.run(
            "sbatch", "--parsable", *CPU_NODE, export, "--chdir", str(job_dir), str(TEMPLATE), *args
        ).strip()
        jobs[name] = (job, job_dir / f"uma-{job}.log", job_dir / "run" / "checkpoints")

    waiting = dict(jobs)
    deadline = time.monotonic() + 400
    while waiting:  # preempt each job once it has trained PREEMPT_AT_STEP steps
        for name, (job, log, _) in list(waiting.items()):
            if f"step {PREEMPT_AT_STEP}/" in (log.read_text() if log.exists() else ""):
                preempt(slurm, job, name)
                del waiting[name]
        assert time.monotonic() < deadline, {name: slurm.job(job)["JobState"] for name, (job, _, _) in waiting.items()}
        time.sleep(0.1)
    states = {}
    while time.monotonic() < deadline + 300:
        states = {name: slurm.job(job) for name, (job, _, _) in jobs.items()}
        if all(state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") for state in states.values()):
            break
        time.sleep(1)

    for name, (job, log, checkpoints) in jobs.items():
        text = log.read_text()
        state = states[name]
        assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), (
            name,
            state,
            text[-3000:],
        )
        status = 138 if name == "SIGUSR1" else 143
        assert text.count(f"received {name}: saving a checkpoint") == 1, text[-3000:]
        ((step, checkpoint),) = [(s, c) for s, c in committed(checkpoints) if s != MAX_STEPS][-1:]
        assert PREEMPT_AT_STEP <= step < MAX_STEPS and verify(checkpoint) == []
        saved = text.index(f"{name}: checkpoint of step {step} committed, exiting with status {status}")
        assert f"srun: error: {slurm.node}: task 0: Exited with exit code {status}" in text
        # One log, appended to: the first run, then the requeued one resuming where it stopped.
        assert text.count(f"training: {MAX_STEPS} steps") == 2
        assert (
            saved
            < text.index(f"resumed from {checkpoint}: step {step}")
            < text.index(f"trained {MAX_STEPS - step} steps")
        )
        assert committed(checkpoints)[-1][0] == MAX_STEPS
        assert "Traceback" not in text, text
        # Each attempt runs one thread on its one CPU: two jobs sharing a node ran 30 times slower with one per core.
        assert text.count("CPU threads: 1 per process (SLURM_CPUS_PER_TASK=1;") == 2, text
        if name == "SIGUSR1":
            assert f"requeued Slurm job {job}" in text
