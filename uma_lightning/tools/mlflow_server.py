"""A local ``mlflow server`` that receives training runs, started and waited for (the tests' server
and the MLflow UI benchmark's), and the wait for any such server to answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from uma_lightning.ports import free_port

# Without it the server also starts MLflow's job runner (seven more Python processes, for server-side
# GenAI jobs), which doubled its start-up CPU time (18 s against 9.5 s on 2 cores).
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow_server(
    backend_store_uri: str,
    log_path: Path,
    artifacts: Optional[Path] = None,
    timeout_s: float = 180,
    port: Optional[int] = None,
) -> tuple[subprocess.Popen, str]:
    """Start ``mlflow server`` on ``port`` (default: a free one) of 127.0.0.1, its output to ``log_path``;
    return it and its URL once it answers ``/health``. Raises RuntimeError with the log's end if it does not."""
    port = port or free_port()
    command = [
        shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        backend_store_uri,
    ]
    if artifacts is not None:
        command += ["--artifacts-destination", str(artifacts)]
    with open(log_path, "a") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV})
    url = f"http://127.0.0.1:{port}"
    wait_until_answering(server, f"{url}/health", log_path, "mlflow server", timeout_s)
    return server, url


def wait_until_answering(process: subprocess.Popen, url: str, log_path: Path, name: str, timeout_s: float) -> None:
    """Return once ``url`` answers; if ``process`` exits or ``timeout_s`` passes first, kill it and
    raise RuntimeError with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(
                    f"{name} did not start; the end of {log_path}:\n{log_path.read_text()[-3000:]}"
                ) from None
            time.sleep(0.5)
