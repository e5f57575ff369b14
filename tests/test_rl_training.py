"""`uma rl` end to end: recipes, config errors, learning checks, MLflow metrics, resume after a kill, DDP."""

import json
import os
import signal
import subprocess
import sys
import time

import forked_cli
import pytest
import torch
import yaml
from mlflow import MlflowClient
from suite import REPO, recipe, run_main

from uma_lightning.tools.rl import RLCLI

DEFAULT, PPO, SAC = recipe("rl"), recipe("rl_inverted_pendulum"), recipe("rl_pendulum_sac")


def test_default_recipe_trains_ppo_on_humanoid_and_resolves_fully(capsys):
    code, out, err = run_main(["rl", "--config", DEFAULT, "--print_config"], capsys)
    assert code == 0, err
    config = yaml.safe_load(out)
    assert config["model"]["class_path"] == "uma_lightning.rl.PPOLearner"
    assert config["data"]["init_args"]["env"] == "Humanoid-v5"
    assert config["data"]["init_args"]["total_env_steps"] >= 1_000_000
    assert config["ckpt_path"] == "last"  # the same command resumes
    assert config["trainer"]["logger"]["init_args"]["experiment_name"] == "rl"


def test_bad_env_or_key_stops_with_a_short_error(capsys):
    code, _, err = run_main(["rl", "--config", DEFAULT, "--data.env", "Humanoidd-v5"], capsys)
    assert code == 2
    assert "data.env: env 'Humanoidd-v5'" in err and "Did you mean: `Humanoid`" in err
    code, _, err = run_main(["rl", "--config", DEFAULT, "--data.max_policy_lagg", "2"], capsys)
    assert code == 2 and "takes no argument 'max_policy_lagg'; did you mean 'max_policy_lag'" in err


@pytest.mark.slow(seconds=20)
def test_ppo_learns_inverted_pendulum_and_logs_rl_metrics_to_mlflow(tmp_path):
    start = time.monotonic()
    cli = RLCLI(
        [
            "--config",
            PPO,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger.init_args.store_dir",
            str(tmp_path / "mlruns"),
        ]
    )
    elapsed = time.monotonic() - start
    data, metrics = cli.datamodule, cli.trainer.callback_metrics
    print(
        f"PPO InvertedPendulum-v5: mean return {float(metrics['rollout/return_window']):.1f} over the last 20 episodes "
        f"after {data.env_steps} env steps, {elapsed:.1f} s"
    )
    assert float(metrics["rollout/return_window"]) >= 500
    assert data.env_steps < data.hparams.total_env_steps  # stopped because it was solved, within the budget

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_inverted_pendulum").experiment_id])
    history = lambda name: client.get_metric_history(run.info.run_id, name)  # noqa: E731
    for name in (
        "rollout/episode_return",
        "rollout/episode_length",
        "throughput/env_steps_per_sec",
        "throughput/learner_samples_per_sec",
        "time/wait_for_data_sec",
        "policy_lag/mean",
        "actors/restarts",
        "train/policy_loss",
        "train/value_loss",
    ):
        assert history(name), f"metric {name} not logged"
    iterations = data.env_steps // 512
    assert len(history("policy_lag/lag_0")) == iterations
    assert all(m.value == 1.0 for m in history("policy_lag/lag_0"))  # synchronous: every chunk from the newest policy
    assert max(m.value for m in history("rollout/env_steps")) == data.env_steps
    assert all(m.value == 0 for m in history("actors/restarts"))


@pytest.mark.slow(seconds=25)
@pytest.mark.crowd  # the learner and its actor take turns, every chunk
def test_sac_learns_pendulum_with_the_replay_buffer(tmp_path):
    start = time.monotonic()
    cli = RLCLI(["--config", SAC, "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false"])
    elapsed = time.monotonic() - start
    data, metrics = cli.datamodule, cli.trainer.callback_metrics
    print(
        f"SAC Pendulum-v1: mean return {float(metrics['rollout/return_window']):.1f} over the last 10 episodes "
        f"after {data.env_steps} env steps, {elapsed:.1f} s"
    )
    assert float(metrics["rollout/return_window"]) > -400
    assert data.env_steps < data.hparams.total_env_steps
    assert len(cli.model.buffer) == data.env_steps


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_with_the_same_command(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        "--config",
        SAC,
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.logger",
        "false",
        "--data.total_env_steps",
        "2000",
        "--model.learning_starts",
        "300",
        "--model.updates_per_step",
        "0.25",
    ]
    last = run_dir / "checkpoints" / "last.ckpt"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = forked_cli.start(["rl", *command], first_log, tmp_path)  # a process of its own, as `uma rl` is
    deadline = time.monotonic() + 300
    while not (last.exists() and torch.load(last, weights_only=True)["policy_version"] >= 5):
        assert first.is_alive() and time.monotonic() < deadline, first_log.read_text()[-3000:]
        time.sleep(0.5)
    os.kill(first.pid, signal.SIGKILL)  # no chance to clean up or save
    first.join(timeout=30)
    killed_at = torch.load(last, weights_only=True)
    steps_at_kill = killed_at["RolloutDataModule"]["env_steps"]
    assert 0 < steps_at_kill < 2000

    assert forked_cli.run(["rl", *command], second_log, tmp_path, timeout=600) == 0, second_log.read_text()[-3000:]
    out = second_log.read_text()
    assert f"resuming at {steps_at_kill}" in out
    final = torch.load(last, weights_only=True)
    # Every iteration is accounted for once, and the buffer holds the transitions from before the kill too.
    assert final["RolloutDataModule"]["env_steps"] == 2000
    assert final["policy_version"] == 2000 // 100
    assert final["replay_buffer"]["size"] == 2000


@pytest.mark.slow
def test_ddp_learner_keeps_ranks_identical_while_each_collects_its_own_data(tmp_path):
    digests, log = tmp_path / "digests", tmp_path / "ddp.log"
    # The two ranks started as torchrun starts them (Lightning joins them instead of launching its own).
    statuses = forked_cli.run_as_ranks(
        ["rl", "--config", PPO, "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy.class_path", "lightning.pytorch.strategies.DDPStrategy",
         "--data.n_workers", "1", "--data.total_env_steps", "2048",
         "--trainer.callbacks+=rl_checks.PolicyDigest", f"--trainer.callbacks.out_dir={digests}"],
        log, tmp_path, timeout=600)  # fmt: skip
    assert statuses == [0, 0], log.read_text()[-3000:]
    ranks = [json.loads((digests / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    # 256 env steps per iteration and rank: the 2048-step budget is split, 4 iterations each.
    assert [r["env_steps"] for r in ranks] == [1024, 1024]
    assert ranks[0]["policy_version"] == ranks[1]["policy_version"] == 4
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > 0
    # Different data on each rank, identical weights and observation statistics after every update.
    assert ranks[0]["digest"] == ranks[1]["digest"]


@pytest.mark.slow(seconds=20)
def test_gpu_rl_case_cpu_smoke_runs_from_a_checkout_without_the_package_installed(tmp_path):
    """The GPU machine's RL case (14 actors, server inference, learner on the GPU), run as that machine
    runs it, without uma-lightning installed, on the CPU at tiny sizes."""
    script = REPO / "benchmarks" / "gpu" / "rl_throughput.py"
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    code = f"import sys, runpy; sys.path[:0] = {site_packages!r}; sys.argv = ['rl_throughput.py', '--cpu-smoke']; runpy.run_path({str(script)!r}, run_name='__main__')"
    # -S: no site hooks, so the editable install's import hook is not there.
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "=== RL throughput" in out.stdout and "FAILED" not in out.stdout
    assert "pipeline, server inference (trained)" in out.stdout and "pipeline / raw: " in out.stdout
