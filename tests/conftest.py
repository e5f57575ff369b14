import os

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
