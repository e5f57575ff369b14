"""Facts that make a run reproducible from its tracking page: code version and diff, installed
packages, machine, world layout and the environment variables that change how training runs."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

import psutil
import torch

PACKAGE_DIR = Path(__file__).resolve().parents[1]

# Variables that change what a run does or where it runs; names that look like secrets never go out.
ENV_PREFIXES = (
    "CUDA_",
    "CUDNN_",
    "NCCL_",
    "NVIDIA_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "SLURM_",
    "UMA_",
    "MASTER_",
    "TORCHELASTIC_",
)
ENV_NAMES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTHONHASHSEED",
    "PYTHONPATH",
    "TOKENIZERS_PARALLELISM",
)
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def _git(args: list[str], cwd: str | Path, timeout: float = 30) -> Optional[str]:
    try:
        result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def git_root(cwd: str | Path = ".") -> Optional[Path]:
    top = _git(["rev-parse", "--show-toplevel"], cwd, timeout=10)
    return Path(top.strip()) if top else None


def git_state(cwd: str | Path = ".") -> dict[str, str]:
    """Commit and dirty flag of the git repository around ``cwd``; empty outside a repository."""
    commit = _git(["rev-parse", "HEAD"], cwd, timeout=10)
    status = _git(["status", "--porcelain"], cwd) if commit else None
    if commit is None or status is None:
        return {}
    return {"git.commit": commit.strip(), "git.dirty": str(bool(status.strip())).lower()}


def git_diff(cwd: str | Path = ".") -> Optional[str]:
    """Uncommitted changes against HEAD as a patch, then the untracked files by name; None outside a repository."""
    diff = _git(["diff", "HEAD", "--no-color"], cwd)
    untracked = _git(["ls-files", "--others", "--exclude-standard"], cwd)
    if diff is None or untracked is None:
        return None
    names = untracked.split()
    return diff + "".join(f"# untracked: {name}\n" for name in names)


def software_versions() -> dict[str, str]:
    versions = {"version.python": platform.python_version()}
    for package in ("torch", "lightning", "uma-lightning"):
        try:
            versions[f"version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[f"version.{package}"] = "not installed"
    if torch.version.cuda:
        versions["version.cuda"] = torch.version.cuda
    return versions


def installed_packages() -> str:
    """Every installed distribution as ``name==version`` lines, sorted, like ``pip freeze``."""
    seen = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return "".join(line + "\n" for _, line in sorted(seen.items()))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, str]:
    facts = {
        "hw.cpu": cpu_model(),
        "hw.cpu_threads": str(os.cpu_count()),
        "hw.cpu_cores": str(psutil.cpu_count(logical=False)),
        "hw.memory_gib": f"{psutil.virtual_memory().total / 2**30:.1f}",
        "hw.gpu_count": str(torch.cuda.device_count()),
    }
    if torch.cuda.is_available():
        facts["hw.gpu"] = torch.cuda.get_device_name(0)
        facts["hw.gpu_memory_gib"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"
    return facts


def chosen_environment(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {
        name: value
        for name, value in sorted(environ.items())
        if (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) and not SECRET.search(name)
    }


def rank_facts(global_rank: int, local_rank: int, node_rank: int, device: torch.device) -> dict:
    """This process's place in the world, as gathered from every rank into ``world.json``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {
        "rank": global_rank,
        "local_rank": local_rank,
        "node_rank": node_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "device_name": name,
    }


def run_tags(world_size: int) -> dict[str, str]:
    tags = {
        **git_state(),
        **software_versions(),
        **hardware(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "command": " ".join(sys.argv),
        "world_size": str(world_size),
    }
    package_root = git_root(PACKAGE_DIR)
    if package_root is not None and package_root != git_root("."):
        # Research code in one repository, uma_lightning checked out in another: record both.
        tags.update({f"uma_lightning.{key}": value for key, value in git_state(PACKAGE_DIR).items()})
    return tags


def write_provenance(out_dir: Path, world: list[dict]) -> None:
    """Writes the long facts (diffs, packages, environment, world layout) as files into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    diff = git_diff(".")
    if diff is not None:
        (out_dir / "git_diff.patch").write_text(diff)
    package_root = git_root(PACKAGE_DIR)
    if package_root is not None and package_root != git_root("."):
        package_diff = git_diff(PACKAGE_DIR)
        if package_diff is not None:
            (out_dir / "uma_lightning_git_diff.patch").write_text(package_diff)
    (out_dir / "pip_freeze.txt").write_text(installed_packages())
    (out_dir / "environment.json").write_text(json.dumps(chosen_environment(), indent=2) + "\n")
    nodes = sorted({rank["host"] for rank in world})
    layout = {"world_size": len(world), "nodes": nodes, "ranks": world}
    (out_dir / "world.json").write_text(json.dumps(layout, indent=2) + "\n")
