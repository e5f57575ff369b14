"""Hang watchdog: one of two ranks (DDP over gloo, each a real `uma fit` process) hangs in its
training step; both ranks dump their stacks and flight recorders and exit non-zero within the
timeout plus a small slack."""

import json
import pickle
import time
from pathlib import Path

import forked_cli
import pytest
from mlflow import MlflowClient
from suite import QUICK, RECIPE

from uma_lightning.data.generate import ensure_dataset
from uma_lightning.tracking.mlflow_logger import local_store_uri

TIMEOUT_S, HANG_STEP, EXIT_CODE = 6.0, 3, 75
SLACK_S = 12.0  # polling, writing the dumps, reporting to MLflow, on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.alone  # exits are timed against the watchdog's timeout
def test_a_hung_rank_dumps_stacks_on_every_rank_and_exits(tmp_path, mlflow_store):
    ensure_dataset("planar_arm", 6, 64, 0, None)  # generated once here, not raced by two ranks
    run_dir, marker = tmp_path / "run", tmp_path / "hang_started.json"
    callbacks = [
        {"class_path": "uma_lightning.callbacks.HangWatchdog", "init_args": {"timeout_s": TIMEOUT_S}},
        # The other per-step diagnostics come along, so their collectives run across two real ranks.
        {"class_path": "uma_lightning.callbacks.StepTimeBreakdown"},
        {"class_path": "uma_lightning.callbacks.GradientAnomalies"},
        {"class_path": "uma_lightning.callbacks.MemoryMonitor"},
    ]
    command = [
        "fit",
        "--config",
        RECIPE,
        *QUICK,
        "--model",
        "faults.FaultyPretrain",
        "--model.hang_at_step",
        str(HANG_STEP),
        "--model.hang_rank",
        "1",
        "--model.hang_marker",
        str(marker),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy.class_path",
        "lightning.pytorch.strategies.DDPStrategy",  # its comm hook times the all-reduces
        "--trainer.max_steps",
        "50",
        "--trainer.val_check_interval",
        "100",
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.logger.init_args.store_dir",
        str(mlflow_store),
        "--trainer.logger.init_args.experiment_name",
        "hang",
        "--trainer.callbacks",
        json.dumps(callbacks),
    ]
    # Two ranks started side by side, as a scheduler (or torchrun) does; Lightning joins them into one DDP group.
    log = tmp_path / "job.log"
    ranks = forked_cli.start_ranks(command, log, tmp_path)
    exited_at = [None, None]
    deadline = time.time() + 300
    while None in exited_at and time.time() < deadline:
        for rank, process in enumerate(ranks):
            if exited_at[rank] is None and process.exitcode is not None:
                exited_at[rank] = time.time()
        time.sleep(0.05)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    output = [forked_cli.rank_log(log, rank).read_text() for rank in range(2)]
    assert None not in exited_at, f"a rank did not exit:\n{output[0][-3000:]}\n{output[1][-3000:]}"

    # Both ranks exit non-zero, after the timeout and within it plus the slack.
    assert [p.exitcode for p in ranks] == [EXIT_CODE, EXIT_CODE], output
    hang_started = json.loads(marker.read_text())["time"]
    for rank in range(2):
        assert TIMEOUT_S - 1 < exited_at[rank] - hang_started < TIMEOUT_S + SLACK_S, (
            rank,
            exited_at[rank] - hang_started,
        )
    # The hung rank times out; the waiting one times out too, or first sees its peer leave: either is this hang.
    assert "hang: rank 1 made no progress" in output[1]
    assert "hang: rank 0 made no progress" in output[0] or "hang: rank 0 lost a peer in a collective" in output[0]

    # Stacks of every thread of both ranks: rank 1 sleeps in its training step; rank 0 waits in the
    # collective that averages the step's loss over the ranks. Both time out within a poll of each
    # other, so rank 1 may exit first: rank 0's collective then fails, and its dump (a poll later)
    # finds its main thread unwinding through Lightning's error handling instead.
    stacks = [(run_dir / "hang" / f"stacks_rank{rank}.txt").read_text() for rank in range(2)]
    assert "in training_step" in stacks[1] and "faults.py" in stacks[1] and "distributed_c10d.py" not in stacks[1]
    in_collective = "in training_step" in stacks[0] and "distributed_c10d.py" in stacks[0]
    assert in_collective or (exited_at[1] <= exited_at[0] and "_call_and_handle_interrupt" in stacks[0]), stacks[0][
        -4000:
    ]
    assert all(s.count("Thread 0x") + s.count("Current thread 0x") >= 2 for s in stacks)  # every thread, not one
    # The flight recorders: rank 0 issued the all-reduce of the hung step, rank 1 never did.
    seq = []
    for rank in range(2):
        trace = pickle.loads((run_dir / "hang" / f"flight_recorder_rank{rank}.pkl").read_bytes())
        seq.append(max(entry["collective_seq_id"] for entry in trace["entries"]))
    assert seq[0] > seq[1]
    event = json.loads((run_dir / "hang" / "event_rank1.json").read_text())
    assert event["step"] == HANG_STEP and event["seconds_without_progress"] >= TIMEOUT_S

    # Rank 0 reported to MLflow: a tag, the dumps as artifacts, the run failed; steps before it logged.
    client = MlflowClient(local_store_uri(mlflow_store))
    (run,) = client.search_runs([client.get_experiment_by_name("hang").experiment_id])
    assert run.info.status == "FAILED"
    assert json.loads(run.data.tags["watchdog.hang"])["rank"] == 0
    assert "stacks_rank0.txt" in [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "hang")]
    for metric in ("time/comm_ms", "memory/cpu_rss_mib", "grad_norm"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == list(range(HANG_STEP)), metric
    world = json.loads((run_dir / "provenance" / "world.json").read_text())
    assert world["world_size"] == 2 and [r["rank"] for r in world["ranks"]] == [0, 1]
