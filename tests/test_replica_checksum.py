"""Silent corruption of replicated weights: one weight perturbed on one rank of a two-process DDP run
is named, with its rank, at the next check; the checks before it stay quiet."""

import json

import forked_cli
import pytest
import torch
from mlflow import MlflowClient
from suite import QUICK, RECIPE

from uma_lightning.callbacks.replica_checksum import differing_replicas, weight_checksums
from uma_lightning.data.generate import ensure_dataset
from uma_lightning.tracking.mlflow_logger import local_store_uri

EVERY, PERTURBED_AT, PERTURBED = 2, 5, "model.action_head.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_checksum_changes_with_the_smallest_change_of_one_element(dtype):
    weights = torch.randn(64, 32, dtype=dtype)
    nudged = weights.clone()
    nudged[7, 3] = torch.nextafter(nudged[7, 3], torch.tensor(float("inf"), dtype=dtype))
    same, changed = weight_checksums([weights, weights.clone()]), weight_checksums([weights, nudged])
    assert same[0] == same[1] and changed[0] != changed[1]


def test_a_checksum_is_the_exact_wrapped_sum_of_the_bits_in_any_order():
    weights = torch.randn(100_000) * 1e6  # bit patterns whose sum wraps int32 many times
    exact = sum(weights.view(torch.int32).tolist()) % 2**32
    expected = exact - 2**32 if exact >= 2**31 else exact
    shuffled = weights[torch.randperm(len(weights))]
    assert weight_checksums([weights, shuffled]).tolist() == [expected, expected]


def test_the_replica_that_differs_from_the_majority_is_named_among_those_holding_the_same_shard():
    names = ["a", "b"]
    # Tensor a: replica 2 is the odd one out. Tensor b is sharded (keys 0 and 1): replicas 0 and 2 hold
    # one half, 1 and 3 the other, so different checksums across the halves are expected.
    checksums = [[5, 10], [5, 20], [6, 10], [5, 20]]
    keys = [[0, 0], [0, 1], [0, 0], [0, 1]]
    assert differing_replicas(checksums, keys, names) == {2: ["a"]}
    assert differing_replicas([[1, 10], [1, 10]], [[0, 0], [0, 0]], names) == {}
    # Two replicas: the lower one's value is the reference.
    assert differing_replicas([[1, 10], [2, 10]], [[0, 0], [0, 0]], names) == {1: ["a"]}


def two_rank_run(tmp_path, action: str, *extra_callbacks: dict):
    """The quick recipe under ``ddp`` on two CPU processes for 8 steps, replicas compared every 2 steps
    with ``action``, the weight perturbed on rank 1 after step 5; (exit statuses, both ranks' output,
    the MLflow history of ``replica/differing_tensors`` as sorted (step, value) pairs)."""
    ensure_dataset("planar_arm", 6, 64, 0, None)  # generated once here, not raced by two ranks
    callbacks = [
        {
            "class_path": "uma_lightning.callbacks.ReplicaChecksum",
            "init_args": {"every_n_steps": EVERY, "action": action},
        },
        {"class_path": "faults.PerturbWeight", "init_args": {"step": PERTURBED_AT, "rank": 1, "parameter": PERTURBED}},
        *extra_callbacks,
    ]
    command = ["fit", "--config", RECIPE, *QUICK, "--trainer.accelerator", "cpu", "--trainer.devices", "2",
               "--trainer.strategy", "ddp", "--trainer.max_steps", "8", "--trainer.val_check_interval", "100",
               "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger.init_args.experiment_name",
               "replicas", "--trainer.callbacks", json.dumps(callbacks)]  # fmt: skip
    log = tmp_path / "job.log"
    codes = forked_cli.run_as_ranks(command, log, tmp_path, timeout=240)
    client = MlflowClient(local_store_uri(tmp_path / "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("replicas").experiment_id])
    history = client.get_metric_history(run.info.run_id, "replica/differing_tensors")
    return codes, log.read_text(), sorted((m.step, m.value) for m in history)


FOUND = f"rank 1 differs from the other replicas in 1 weight(s): {PERTURBED}"


@pytest.mark.slow(seconds=30)
@pytest.mark.crowd  # two ranks that wait on each other every step
def test_a_weight_perturbed_on_one_rank_halts_both_ranks_at_the_next_check_naming_them(tmp_path):
    codes, output, history = two_rank_run(tmp_path, "halt")
    assert codes == [3, 3], output[-4000:]  # both ranks halt (TrainingHalted)
    halted = f"uma: training halted: replicated weights differ after step {PERTURBED_AT + 1}: {FOUND}"
    assert output.count(halted) == 2, output[-4000:]
    assert output.count(f"replica checksum after step {PERTURBED_AT + 1}: {FOUND}; action halt") == 1
    assert "replica checksum: 20 weights compared across 2 replicas every 2 steps (action halt)" in output
    # Quiet before: the checks after steps 2 and 4 found nothing, the one after the perturbation one
    # tensor; on MLflow's step axis, which numbers the batches from 0, at 1, 3 and 5.
    assert history == [(1, 0.0), (3, 0.0), (5, 1.0)]


@pytest.mark.slow(seconds=35)
@pytest.mark.crowd
def test_a_rollback_makes_the_replicas_equal_again_and_training_goes_on(tmp_path):
    checkpoints = {"every_n_steps": 2, "keep_last": 10, "async_save": False}
    codes, output, history = two_rank_run(
        tmp_path, "rollback", {"class_path": "uma_lightning.callbacks.ShardedCheckpoint", "init_args": checkpoints}
    )
    assert codes == [0, 0], output[-4000:]
    assert f"replica checksum after step {PERTURBED_AT + 1}: {FOUND}; action rollback" in output
    assert "replica checksum: rolled back from step 6 to step 4" in output
    # Steps 5 and 6 trained again from the step-4 checkpoint (axis 4 and 5), and the replicas agree
    # from then on, at the end too.
    assert history == [(1, 0.0), (3, 0.0), (5, 0.0), (5, 1.0), (7, 0.0)]
