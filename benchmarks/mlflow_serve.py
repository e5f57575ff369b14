"""A trained policy served over HTTP by MLflow, as a fresh user would: register, serve, query, compare.

Trains a tiny pretrain run (or takes --checkpoint), starts `mlflow server` on 127.0.0.1, registers the
policy with `uma ckpt export CHECKPOINT --format mlflow --register NAME`, serves it with

    mlflow models serve -m models:/NAME/1 --env-manager local -h 127.0.0.1 -p PORT

then POSTs batches of observations to /invocations and compares the actions with `Policy` run in
this process on the same observations, and prints the request latency beside the in-process one.

    python benchmarks/mlflow_serve.py --out /tmp/mlflow_serve [--checkpoint runs/pretrain/checkpoints]

Not part of the test suite (tests/test_policy_model.py serves a registered model through
``serve_and_compare``); with training, about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from mlflow import MlflowClient

from uma_lightning.policy import Policy
from uma_lightning.ports import free_port
from uma_lightning.tools.mlflow_server import start_mlflow_server, wait_until_answering

REPO = Path(__file__).resolve().parents[1]
TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
INSTRUCTIONS = ["reach the red square", "touch the blue circle", "go to the green triangle"]


def executable(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


def train(run_dir: Path) -> Path:
    """A tiny pretrain run of 20 steps, without tracking; returns its checkpoints directory."""
    command = [executable("uma"), "fit", "--config", str(REPO / "recipes" / "pretrain.yaml"),
               "--model.network.size", json.dumps(TINY), "--data.generation.n_episodes", "6",
               "--data.loader.num_workers", "0", "--trainer.max_steps", "20", "--trainer.val_check_interval", "20",
               "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
               "--trainer.default_root_dir", str(run_dir)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run_dir / "checkpoints"


def observations(policy: Policy, batch: int, seed: int) -> dict:
    """``batch`` random observations of the shapes ``policy`` takes (numpy, as a client has them)."""
    spec, gen = policy.spec, torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), generator=gen)
    state = policy.state_offset.cpu() + policy.state_scale.cpu() * torch.randn(
        batch, spec.n_obs_steps, spec.state_dim, generator=gen
    )
    return {
        "images": images.to(torch.uint8).numpy(),
        "state": state.numpy(),
        "instruction": np.array([INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)]),
    }


def serve(model_uri: str, tracking_uri: str, log_path: Path, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """``mlflow models serve`` of ``model_uri`` on a free port of 127.0.0.1, once it answers /ping."""
    port = free_port()
    command = [executable("mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
               "-h", "127.0.0.1", "-p", str(port)]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
        )
    url = f"http://127.0.0.1:{port}"
    wait_until_answering(server, f"{url}/ping", log_path, "mlflow models serve", timeout_s)
    return server, url


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def invoke(url: str, observation: dict) -> np.ndarray:
    """The actions the server returns for ``observation`` (POST /invocations, MLflow's "inputs" format)."""
    body = json.dumps({"inputs": {name: value.tolist() for name, value in observation.items()}}).encode()
    request = urllib.request.Request(f"{url}/invocations", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return np.asarray(json.loads(response.read())["predictions"], dtype=np.float32)


def serve_and_compare(
    model_uri: str, tracking_uri: str, checkpoint: Path, log_path: Path, requests: int = 10, batch: int = 4
) -> dict:
    """Serve ``model_uri``, send ``requests`` batches, and compare each answer with ``Policy`` on
    ``checkpoint``: the largest absolute difference, and the median latencies over HTTP and in process."""
    policy = Policy.from_checkpoint(checkpoint)
    server, url = serve(model_uri, tracking_uri, log_path)
    try:
        http, local, largest = [], [], 0.0
        for index in range(requests):
            observation = observations(policy, batch, seed=index)
            start = time.perf_counter()
            served = invoke(url, observation)
            http.append(time.perf_counter() - start)
            start = time.perf_counter()
            expected = policy(observation).numpy()
            local.append(time.perf_counter() - start)
            assert served.shape == expected.shape, (served.shape, expected.shape)
            largest = max(largest, float(np.abs(served - expected).max()))
    finally:
        stop(server)
    return {
        "requests": requests,
        "batch": batch,
        "max_abs_diff": largest,
        "http_ms_median": 1000 * statistics.median(http),
        "policy_ms_median": 1000 * statistics.median(local),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the run, the store and the logs")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint to serve (default: train a tiny one)")
    parser.add_argument("--name", default="uma-policy", help="registered model name")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or train(args.out / "run")
    store = args.out / "store"
    store.mkdir(exist_ok=True)
    tracking, url = start_mlflow_server(
        f"sqlite:///{store / 'mlflow.db'}", args.out / "mlflow_server.log", artifacts=store / "artifacts"
    )
    try:
        from uma_lightning.tools.ckpt import main as ckpt

        start = time.perf_counter()
        code = ckpt(["export", str(checkpoint), "--format", "mlflow", "--tracking-uri", url, "--register", args.name])
        if code:
            sys.exit(code)
        print(f"registered in {time.perf_counter() - start:.1f} s")
        version = max(int(v.version) for v in MlflowClient(url).search_model_versions(f"name = '{args.name}'"))
        start = time.perf_counter()
        result = serve_and_compare(
            f"models:/{args.name}/{version}", url, checkpoint, args.out / "serve.log", args.requests, args.batch
        )
        print(f"served and queried in {time.perf_counter() - start:.1f} s")
    finally:
        stop(tracking)
    print(
        f"models:/{args.name}/{version} over HTTP: {result['requests']} requests of {result['batch']} observations, "
        f"median {result['http_ms_median']:.1f} ms (Policy in process: {result['policy_ms_median']:.1f} ms); "
        f"largest difference from Policy: {result['max_abs_diff']}"
    )


if __name__ == "__main__":
    main()
