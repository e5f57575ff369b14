"""Facts that make a run reproducible from its tracking page: code version, software, machine."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from importlib import metadata


def git_state(cwd: str = ".") -> dict[str, str]:
    """Commit and dirty flag of the git repository around ``cwd``; empty outside a repository."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {}
        status = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {"git.commit": commit.stdout.strip(), "git.dirty": str(bool(status.stdout.strip())).lower()}


def software_versions() -> dict[str, str]:
    versions = {"version.python": platform.python_version()}
    for package in ("torch", "lightning", "uma-lightning"):
        try:
            versions[f"version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[f"version.{package}"] = "not installed"
    return versions


def run_tags(world_size: int) -> dict[str, str]:
    return {
        **git_state(),
        **software_versions(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "command": " ".join(sys.argv),
        "world_size": str(world_size),
    }
