import os
import socket
from types import SimpleNamespace

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter, so the kernel tests check the kernels
# themselves on any machine. Read when a kernel is defined, so it is set before any is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory):
    """Generated datasets go to one cache per test session; nothing logs to a real tracking server."""
    cache = tmp_path_factory.mktemp("uma_cache")
    saved = {key: os.environ.get(key) for key in ("UMA_CACHE_DIR", "MLFLOW_TRACKING_URI")}
    os.environ["UMA_CACHE_DIR"] = str(cache)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def no_tracking_uri_left_behind():
    """``mlflow.set_tracking_uri`` exports $MLFLOW_TRACKING_URI: a test that calls it (a server
    test) must not send the runs of later tests' child processes to its store."""
    yield
    os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """One embedded MLflow store for the session's training runs: creating its tables takes seconds."""
    return tmp_path_factory.mktemp("mlruns")


# ---- expensive runs that several tests read: one each per session -------------------------------
# A new test that needs a trained run reads one of these (or adds one here) rather than training
# its own. They must be treated as read-only: a test that changes a run copies it to its tmp_path.

PRETRAIN_STEPS = 30


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> SimpleNamespace:
    """The pretrain recipe run as a user runs it, in a fresh directory and a process of its own, on
    the stage tests' small data: the recipe test reads its log and MLflow run, the pipeline test
    mid-trains from its checkpoint."""
    import forked_cli  # imports the package: only after TRITON_INTERPRET is set, above
    from suite import STAGE_DATA, recipe

    cwd = tmp_path_factory.mktemp("pretrained")
    argv = ["fit", "--config", recipe("pretrain"), *STAGE_DATA, "--data.batch_size", "16",
            "--trainer.max_steps", str(PRETRAIN_STEPS), "--trainer.val_check_interval", str(PRETRAIN_STEPS)]  # fmt: skip
    log = cwd / "pretrain.log"
    code = forked_cli.run(argv, log, cwd, timeout=900)
    return SimpleNamespace(
        code=code, log=log.read_text(), cwd=cwd, steps=PRETRAIN_STEPS,
        checkpoints=cwd / "runs" / "pretrain" / "checkpoints", store=f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}",
    )  # fmt: skip


@pytest.fixture
def s3():
    """A local S3-compatible server (moto) with a bucket `robots`: (its s3fs filesystem, fsspec options)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "key": "test-key",
        "secret": "test-secret",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"},
    }
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.makedirs("robots", exist_ok=True)  # moto's state is per process: an earlier test's server made it already
    yield fs, options
    server.stop()
