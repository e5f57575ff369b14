"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd from Debian's ``slurm-wlm`` and
``munge``, with every file (config, key, state, logs, sockets) in one temporary directory."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from uma_lightning.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
# The grace Slurm gives between SIGTERM and SIGKILL (its default) and the wait before a requeued job may
# start again (120 s by default: the lifetime of a step's credential, which this shortens). A requeued job
# then waits for the next scheduling pass: every second here, not Slurm's 30 s (backfill) or 60 s (main).
KILL_WAIT_S = 30
CRED_EXPIRE_S = 10


class SlurmUnavailable(Exception):
    pass


def _which(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise SlurmUnavailable(f"{name} not found (apt-get install slurm-wlm munge)")
    return path


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self._daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start jobs")
        binaries = {name: _which(name) for name in DAEMONS}
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge / "munge.socket"
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        self.conf.write_text(self._config())
        self._spawn(
            [
                binaries["munged"],
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
                "--foreground",
            ],
            "munged",
        )
        self._wait_for(self.socket.exists, "munged", munge / "munged.log")
        self._spawn([binaries["slurmctld"], "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._spawn([binaries["slurmd"], "-D", "-N", self.node, "-f", str(self.conf)], "slurmd")
        self._wait_for(self._node_idle, "slurmd", self.root / "slurmd.log")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + KILL_WAIT_S + 10  # let slurmd end the jobs' processes before it goes
        while time.monotonic() < deadline and self.run("squeue", "--noheader", check=False).strip():
            time.sleep(0.5)
        for daemon in reversed(self._daemons):
            daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, which jobs inherit, with the cluster's config and ``uma`` on PATH,
        less the thread count the test suite sets for itself (a job's threads are the job's to choose)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        inherited = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        return {**inherited, "SLURM_CONF": str(self.conf), "PATH": path}

    def run(self, *command: str, check: bool = True) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        fields = {}
        for item in self.run("scontrol", "show", "job", "--oneliner", job_id).split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def _node_idle(self) -> bool:
        result = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=self.env, capture_output=True, text=True)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _spawn(self, command: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "w")
        self._daemons.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _wait_for(self, ready, name: str, log: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            exited = [d for d in self._daemons if d.poll() is not None]
            if exited or time.monotonic() > deadline:
                output = "".join(p.read_text()[-1500:] for p in (log, self.root / f"{name}.out") if p.exists())
                self.stop()
                raise SlurmUnavailable(f"{name} did not start: {output.strip() or 'no output'}")
            time.sleep(0.2)

    def _config(self) -> str:
        root = self.root
        return f"""\
ClusterName=umatest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait={KILL_WAIT_S}
# Jobs are not requeueable unless they ask to be (#SBATCH --requeue), as on many clusters.
JobRequeue=0
MinJobAge=3600
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
