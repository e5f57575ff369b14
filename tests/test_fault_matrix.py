"""The fault matrix (docs/guides/faults.md): faults injected into a job of two real gloo ranks at a
random step (the seed is printed; set FAULT_MATRIX_SEED to replay one), and what the job promises
for each: every rank exits within a stated bound, one line names the failed rank and the fault in
every rank's log and in MLflow, the checkpoint before the fault verifies, and the rerun resumes.

The faults share one run: each rerun of the same command resumes from the checkpoint the previous
fault left and goes on to the next fault, and the last rerun finishes. Its final checkpoint must
be the uninterrupted run's, bit for bit.
"""

import json
import os
import random
import re
import signal
import time
import urllib.request
from pathlib import Path

import forked_cli
import psutil
import pytest
import yaml
from checkpoint_helpers import assert_bitwise_equal, checkpoint_tensors
from mlflow import MlflowClient
from suite import QUICK, RECIPE, TINY

from uma_lightning.checkpoint import committed, verify
from uma_lightning.checkpoint.directory import step_dirname
from uma_lightning.data.generate import ensure_dataset, generate_planar_arm
from uma_lightning.tracking.mlflow_logger import local_store_uri

SEED = int(os.environ.get("FAULT_MATRIX_SEED", random.randrange(10_000)))
TIMEOUT_S, REPORT_WAIT_S, LOST_PEER_EXIT = 6.0, 2.0, 75
EXIT_BOUND_S = 20.0  # from the fault to the last rank's exit, for a fault the ranks see at once (loaded 2 cores)
STOP_BOUND_S = TIMEOUT_S + REPORT_WAIT_S + EXIT_BOUND_S  # a stopped rank: the others wait for the watchdog
EVERY_N_STEPS = 2
# (kind, the fault as the line names it, the exit statuses of ranks 0 and 1): rank 0 loses its peer in a
# collective and exits as the hang watchdog does; rank 1 is where the fault is.
FAULTS = [
    ("raise", "RuntimeError: injected fault in step {step}", (LOST_PEER_EXIT, 1)),
    ("segfault", "Fatal Python error: Segmentation fault", (LOST_PEER_EXIT, -signal.SIGSEGV)),
    (
        "worker_segfault",
        "RuntimeError: DataLoader worker (pid {workers[0]}) is killed by signal: Segmentation fault",
        (LOST_PEER_EXIT, 1),
    ),
    ("stop", "left no record (stopped, or stuck where its watchdog cannot run)", (LOST_PEER_EXIT, LOST_PEER_EXIT)),
    ("kill", "left no record (killed by SIGKILL, or stopped)", (LOST_PEER_EXIT, -signal.SIGKILL)),
    ("enospc", "[Errno 28] No space left on device", (2, 2)),
    ("erofs", "[Errno 30] Read-only file system", (2, 2)),
]
# Fault k at a step drawn from its own window of checkpoint intervals, after the checkpoint the rerun resumes from.
STEPS = [EVERY_N_STEPS * (k + 1) + random.Random(SEED + k).randrange(EVERY_N_STEPS) + 1 for k in range(len(FAULTS))]
MAX_STEPS = STEPS[-1] + EVERY_N_STEPS + 1


def write_recipe(
    path: Path, store: Path, fault: dict | None = None, experiment: str = "fault-matrix", world_size: int = 2
) -> str:
    callbacks = [
        {"class_path": "uma_lightning.callbacks.ProgressLog", "init_args": {"every_n_steps": 1}},
        {"class_path": "uma_lightning.callbacks.ShardedCheckpoint", "init_args": {"every_n_steps": EVERY_N_STEPS, "keep_last": 100}},
        {"class_path": "uma_lightning.callbacks.HangWatchdog", "init_args": {"timeout_s": TIMEOUT_S, "report_wait_s": REPORT_WAIT_S}},
        *([{"class_path": "faults.FaultAt", "init_args": fault}] if fault else []),
    ]  # fmt: skip
    recipe = {
        "include": [RECIPE],
        "model": {"init_args": {"network": {"size": TINY}}},
        "data": {"batch_size": 4, "generation": {"n_episodes": 6}, "loader": {"num_workers": 1}},
        "trainer": {
            "accelerator": "cpu",
            "devices": world_size,
            "strategy": "ddp",
            "deterministic": True,
            "max_steps": MAX_STEPS,
            "val_check_interval": 1000,
            "logger": {"init_args": {"store_dir": str(store), "experiment_name": experiment}},
            "callbacks": callbacks,
        },
    }
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def run_job(
    recipe: str, run_dir: Path, log: Path, marker: Path | None = None, stopped: bool = False, world_size: int = 2
):
    """The ranks of ``uma fit``, to their ends: (exit statuses, seconds from the fault to each exit, logs).
    A rank that stops itself is continued once rank 0 has exited, as a launcher ends a job's other ranks."""
    argv = ["fit", "--config", recipe, "--trainer.default_root_dir", str(run_dir)]
    ranks = forked_cli.start_ranks(argv, log, run_dir.parent, world_size)
    exited_at, deadline = [None] * world_size, time.time() + 300
    while None in exited_at and time.time() < deadline:
        for rank, process in enumerate(ranks):
            if exited_at[rank] is None and process.exitcode is not None:
                exited_at[rank] = time.time()
        if stopped and exited_at[0] is not None and None in exited_at and marker.exists():
            os.kill(json.loads(marker.read_text())["pid"], signal.SIGCONT)
            stopped = False
        time.sleep(0.05)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    logs = [forked_cli.rank_log(log, rank).read_text() for rank in range(world_size)]
    assert None not in exited_at, "a rank did not exit:\n" + "\n".join(log[-3000:] for log in logs)
    statuses = [p.exitcode for p in ranks]
    assert marker is None or marker.exists(), f"the job ended (exit statuses {statuses}) before its fault:\n" + (
        "\n".join(log[-3000:] for log in logs)
    )
    started = json.loads(marker.read_text())["time"] if marker else None
    return statuses, [t - started if started else None for t in exited_at], logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mlflow_store):
    """The uninterrupted run's final checkpoint."""
    ensure_dataset("planar_arm", 6, 64, 0, None)  # generated once here, not raced by two ranks
    root = tmp_path_factory.mktemp("reference")
    codes, _, logs = run_job(
        write_recipe(root / "recipe.yaml", mlflow_store, experiment="fault-matrix-reference"),
        root / "run",
        root / "job.log",
    )
    assert codes == [0, 0], logs
    # Quiet without a fault: no line, no record left behind, no tag.
    assert not any("fault: " in log for log in logs) and not (root / "run" / "faults").exists()
    client = MlflowClient(local_store_uri(mlflow_store))
    (run,) = client.search_runs([client.get_experiment_by_name("fault-matrix-reference").experiment_id])
    assert "fault" not in run.data.tags
    return root / "run" / "checkpoints" / step_dirname(MAX_STEPS)


@pytest.mark.slow(seconds=75)  # not `alone`: under two busy-looping processes the exits took up to 8.4 s
def test_each_fault_is_named_on_every_rank_and_the_reruns_end_as_the_uninterrupted_run(
    tmp_path, mlflow_store, reference
):
    print(f"fault matrix: seed {SEED} (FAULT_MATRIX_SEED), faults at steps {STEPS}")
    run_dir = tmp_path / "run"
    client = MlflowClient(local_store_uri(mlflow_store))
    resumable = None  # the newest checkpoint, which the next rerun must resume from
    for (kind, fault, statuses), step in zip(FAULTS, STEPS):
        marker = tmp_path / f"{kind}.json"
        recipe = write_recipe(
            tmp_path / f"{kind}.yaml", mlflow_store, {"kind": kind, "step": step, "marker": str(marker)}
        )
        codes, exit_s, logs = run_job(recipe, run_dir, tmp_path / f"{kind}.log", marker, stopped=kind == "stop")
        context = f"{kind} at step {step}: exit statuses {codes}, exits {exit_s} s after the fault\n" + "\n".join(
            log[-2500:] for log in logs
        )
        if resumable is not None:
            assert f"resumed from {resumable}: step" in logs[0], context
        assert codes == list(statuses), context
        bound = STOP_BOUND_S if kind == "stop" else EXIT_BOUND_S
        assert all(seconds < bound for seconds in exit_s), context

        # One line names rank 1 and the fault, on both ranks and in MLflow. A rank killed by a signal writes
        # nothing more to its log: its fault handler's dump (none after SIGKILL), which the line quotes, is in faults/.
        # (PyTorch's loader worker ends its segfault message with a NUL, on the line before: hence not `startswith`.)
        named = [re.findall(r"fault: (rank 1 failed .*)", log) for log in logs]
        if kind in ("segfault", "kill"):
            fatal = (run_dir / "faults" / "fatal_rank1.txt").read_text()
            assert named[1] == [] and (fault in fatal if kind == "segfault" else fatal == ""), context
            named[1] = named[0]
        assert all(len(lines) == 1 and fault.format(**json.loads(marker.read_text())) in lines[0] for lines in named), (
            context
        )
        named = [lines[0] for lines in named]
        (run,) = client.search_runs([client.get_experiment_by_name("fault-matrix").experiment_id])
        assert run.data.tags["fault"] == named[0], context

        # The checkpoints before the fault verify, and the newest is where the rerun resumes: the one of the
        # step the fault hit if its background write was committed, else the one before. A loader worker's
        # death surfaces when training needs a batch the worker had not made yet: the batches it had queued
        # (prefetch_factor 2, and the one in flight) are trained on first, their checkpoints saved too.
        surfaced = int(re.search(r"failed at step (\d+)", named[0])[1]) if kind == "worker_segfault" else step
        assert step <= surfaced <= step + 3, context
        saved = committed(run_dir / "checkpoints")
        assert saved and all(verify(path) == [] for _, path in saved), context
        resumable = saved[-1][1]
        assert 0 <= surfaced - saved[-1][0] <= EVERY_N_STEPS + 1, context

    codes, _, logs = run_job(write_recipe(tmp_path / "plain.yaml", mlflow_store), run_dir, tmp_path / "plain.log")
    assert codes == [0, 0] and f"resumed from {resumable}: step" in logs[0], logs
    final = run_dir / "checkpoints" / step_dirname(MAX_STEPS)
    assert_bitwise_equal(checkpoint_tensors(final), checkpoint_tensors(reference))


@pytest.mark.slow(seconds=12)
@pytest.mark.crowd  # four ranks that wait on each other every step
def test_four_ranks_agree_on_a_rank_killed_without_a_record(tmp_path, mlflow_store):
    """Where more ranks matter: rank 1 killed by SIGKILL leaves no record; ranks 0, 2 and 3 each lose a peer
    (rank 1, or a rank that exited before them) and all name rank 1, adopting the first one's verdict."""
    ensure_dataset("planar_arm", 6, 64, 0, None)
    step = STEPS[0]
    marker = tmp_path / "kill.json"
    fault = {"kind": "kill", "step": step, "marker": str(marker)}
    recipe = write_recipe(tmp_path / "kill.yaml", mlflow_store, fault, "fault-matrix-four", world_size=4)
    codes, exit_s, logs = run_job(recipe, tmp_path / "run", tmp_path / "kill.log", marker, world_size=4)
    context = f"exit statuses {codes}, exits {exit_s} s after the fault\n" + "\n".join(log[-2000:] for log in logs)
    assert codes == [LOST_PEER_EXIT, -signal.SIGKILL, LOST_PEER_EXIT, LOST_PEER_EXIT], context
    assert all(seconds < EXIT_BOUND_S for seconds in exit_s), context
    expected = f"fault: rank 1 failed at step {step}: left no record (killed by SIGKILL, or stopped)"
    assert [re.findall(r"fault: .*", log) for log in logs] == [[expected], [], [expected], [expected]], context


OUTAGE_STEPS, AWAY_AFTER_STEP, OUTAGE_S = 8, 2, 5.0


@pytest.mark.slow(seconds=35)
def test_a_run_waits_at_its_checkpoint_while_the_mlflow_server_is_away_and_loses_no_metric(tmp_path):
    """The real server (and its worker) killed after step 2, started again 5 s later on the same address and
    store. What holds: the checkpoint of step 2 waits for the metrics before it (MLflow's client retries), so
    training waits there for the server; then it goes on, and every step's metrics arrive. One process: only
    rank zero talks to MLflow."""
    from uma_lightning.tools.mlflow_server import start_mlflow_server

    store, server_log = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "server.log"
    server, url = start_mlflow_server(store, server_log, artifacts=tmp_path / "artifacts")
    callbacks = [
        {"class_path": "uma_lightning.callbacks.ProgressLog", "init_args": {"every_n_steps": 1}},
        {"class_path": "uma_lightning.callbacks.ShardedCheckpoint", "init_args": {"every_n_steps": 2}},
    ]
    argv = ["fit", "--config", RECIPE, *QUICK, "--trainer.max_steps", str(OUTAGE_STEPS),
            "--trainer.val_check_interval", "1000", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.logger.init_args.tracking_uri", url, "--trainer.logger.init_args.experiment_name", "outage",
            "--trainer.callbacks", json.dumps(callbacks)]  # fmt: skip
    log = tmp_path / "fit.log"
    # Retries 1, 2, 4, 8, ... s apart instead of MLflow's 2, 4, 8, 16, ...: the same behaviour, a shorter wait.
    run = forked_cli.start(argv, log, tmp_path, env={"MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"})
    try:
        wait_for_line(log, f"step {AWAY_AFTER_STEP}/{OUTAGE_STEPS}", run)
        kill_tree(server)
        with pytest.raises(OSError):  # gone: nothing answers on its address
            urllib.request.urlopen(f"{url}/health", timeout=5)
        time.sleep(OUTAGE_S)
        output = log.read_text()
        assert run.is_alive() and f"step {AWAY_AFTER_STEP + 2}/" not in output, output[-3000:]  # waiting
        server, _ = start_mlflow_server(
            store, server_log, artifacts=tmp_path / "artifacts", port=int(url.rsplit(":")[-1])
        )
        run.join(300)
        output = log.read_text()
        assert run.exitcode == 0, output[-5000:]
        client = MlflowClient(url)
        (finished,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        assert finished.info.status == "FINISHED", output[-5000:]
        # Every step's loss arrived, each once (MLflow's steps count from 0).
        assert logged_steps(client, "train/loss") == list(range(OUTAGE_STEPS)), output[-5000:]
        # A server killed while answering a batch cuts that response: MLflow says "Failed to log run data",
        # and the logger sends the batch again at the next checkpoint (each step above is stored once).
        assert "Traceback" not in output
        assert "Failed to log" not in output or "since the last flush were not stored" in output, output[-5000:]
    finally:
        if run.is_alive():
            run.kill()
        kill_tree(server)


def kill_tree(server) -> None:
    """Kill ``mlflow server`` and its uvicorn worker, which would go on serving without it."""
    processes = [*psutil.Process(server.pid).children(recursive=True), psutil.Process(server.pid)]
    for process in processes:
        process.kill()
    psutil.wait_procs(processes, timeout=30)


def logged_steps(client: MlflowClient, metric: str) -> list[int]:
    """The steps of ``metric`` in the only run of the experiment ``outage``."""
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, metric))


def wait_for_line(log: Path, text: str, process, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and text in log.read_text()):
        assert process.is_alive() and time.monotonic() < deadline, f"no {text!r} in {log}"
        time.sleep(0.05)


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_dataset_damaged_mid_run_stops_the_run_naming_the_file_and_the_checkpoint_before_verifies(
    tmp_path, where, request
):
    """Every data and video file truncated (local) or deleted (on the S3 server) at a random step. Nothing
    reads a file twice while its rows, frames and handle are held: one open file and a small decode cache
    here (and for S3, a local cache of two files) make the next batch the loader reads meet the damage."""
    step = random.Random(SEED).randrange(3, 6)
    print(f"fault matrix: seed {SEED} (FAULT_MATRIX_SEED), data damaged at step {step}")
    local = generate_planar_arm(tmp_path / "data", n_episodes=6, image_size=32, seed=0)
    if where == "s3":
        fs, options = request.getfixturevalue("s3")
        fs.put(str(local), "robots/damaged", recursive=True)
        largest = max(p.stat().st_size for p in local.rglob("*") if p.suffix in (".parquet", ".mp4"))
        root, how = "s3://robots/damaged", "delete"
        storage = ["--data.storage", json.dumps({"options": options, "cache_dir": str(tmp_path / "cache"),
                                                  "cache_gb": 2 * largest / 2**30, "prefetch_batches": 0})]  # fmt: skip
    else:
        root, how, options, storage = str(local), "truncate", None, []
    damage = {"step": step, "root": root, "how": how, "options": options}
    callbacks = [
        {"class_path": "uma_lightning.callbacks.ShardedCheckpoint", "init_args": {"every_n_steps": 2}},
        {"class_path": "faults.DamageDataAt", "init_args": damage},
    ]
    argv = ["fit", "--config", RECIPE, *QUICK, "--trainer.max_steps", "12", "--data.root", root, *storage,
            "--data.loader.max_open_files", "1", "--data.loader.decode_cache_mb", "0.1",
            "--trainer.val_check_interval", "1000", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.logger", "false", "--trainer.callbacks", json.dumps(callbacks)]  # fmt: skip
    log = tmp_path / "fit.log"
    code = forked_cli.run(argv, log, tmp_path, timeout=300)
    output = log.read_text()
    assert code == 2, output[-5000:]
    (error,) = [line for line in output.splitlines() if line.startswith("uma: error: ")]
    assert re.match(
        rf"uma: error: episode \d+: .*{re.escape(root)}/(data|videos)/chunk-000/\S*episode_\d+\.(parquet|mp4)", error
    ), error
    assert "Traceback" not in output
    # Batches read ahead before the damage still train (they are whole): the checkpoints of their steps verify.
    saved = committed(tmp_path / "run" / "checkpoints")
    assert saved and all(verify(path) == [] for _, path in saved), output[-5000:]
    assert output.index(f"damaged ({how})") < output.index("uma: error: ")
