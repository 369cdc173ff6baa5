"""A one-node Slurm cluster for tests: ``slurmctld`` and ``slurmd`` started from a generated
``slurm.conf`` in a temporary directory, on loopback.

Debian's ``slurm-wlm`` (``make slurm``) provides the daemons. No ``munged`` is needed: the
configuration uses ``AuthType=auth/none`` and ``CredType=cred/none`` (Slurm 22.05 still ships
both plugins), which is only acceptable because everything listens on 127.0.0.1. The node is
called ``localhost`` so the URLs a job builds from its node names (``http://localhost:PORT``)
are loopback names the servers' DNS-rebinding guard accepts.

Example::

    problem = slurm_problem()
    with LocalSlurm(tmp / "slurm") as cluster:
        job = cluster.submit(["--nodes=1", "job.sbatch"], env=env)
        state = cluster.wait_job(job, timeout=600)   # {"JobState": "COMPLETED", ...}
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

from atroposlib.utils.ports import free_port

__all__ = ["LocalSlurm", "SlurmUnavailable", "slurm_problem"]

COMMANDS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmUnavailable(RuntimeError):
    """The daemons could not be started here (the message says why)."""


def _find(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-root PATH may leave out.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def slurm_problem() -> str | None:
    """Why a local cluster cannot be started here, or None when the commands are present."""
    missing = [c for c in COMMANDS if _find(c) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} not found); `make slurm` installs "
            "Debian's slurm-wlm (as root with apt-get)"
        )
    return None


class LocalSlurm:
    """``slurmctld`` + ``slurmd`` for one node named ``localhost`` with ``cpus`` CPUs (declared,
    not checked: steps share them with ``srun --overlap``), state and logs under ``root``."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.env: Dict[str, str] = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: List[subprocess.Popen] = []

    # ----------------------------------------------------------------- lifecycle
    def write_conf(self) -> None:
        user = getpass.getuser()
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=atropos-test",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    f"SlurmUser={user}",
                    f"SlurmdUser={user}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'slurmd.log'}",
                    # No cgroups (containers rarely allow them): processes are tracked by
                    # parentage, which is what the job's clean-up relies on anyway.
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmdParameters=config_overrides",
                    "MinJobAge=600",
                    f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self, timeout: float = 60) -> None:
        """Start both daemons and wait until the node is idle; SlurmUnavailable otherwise."""
        problem = slurm_problem()
        if problem:
            raise SlurmUnavailable(problem)
        self.write_conf()
        for name, args in (
            ("slurmctld", [_find("slurmctld"), "-D", "-f", str(self.conf)]),
            ("slurmd", [_find("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)]),
        ):
            with (self.root / f"{name}.out").open("wb") as out:
                self._daemons.append(
                    subprocess.Popen(
                        args,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=self.env,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for proc in self._daemons:
                if proc.poll() is not None:
                    self.stop()
                    raise SlurmUnavailable(f"a Slurm daemon exited at start:\n{self.logs()}")
            state = self._run(["sinfo", "-h", "-o", "%T"], check=False).strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the node did not become idle (sinfo: {state!r}):\n{self.logs()}")

    def stop(self) -> None:
        """Stop both daemons (SIGTERM, then SIGKILL) and wait for them."""
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in self._daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._daemons.clear()

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- jobs
    def _run(
        self,
        args: Sequence[str],
        check: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        result = subprocess.run(
            [_find(args[0]) or args[0], *args[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(env if env is not None else self.env),
            cwd=cwd,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {result.stderr or result.stdout}")
        return result.stdout

    def submit(self, args: Sequence[str], env: Mapping[str, str], cwd: Path | None = None) -> str:
        """``sbatch --parsable ARGS`` with ``env`` (the job's environment); the job id."""
        out = self._run(
            ["sbatch", "--parsable", *args],
            env={**env, "SLURM_CONF": str(self.conf)},
            cwd=cwd,
        )
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` of ``job_id`` as a dict (JobState, ExitCode, ...)."""
        out = self._run(["scontrol", "-o", "show", "job", job_id])
        fields: Dict[str, str] = {}
        for word in out.split():
            key, sep, value = word.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float) -> Dict[str, str]:
        """Wait until the job has finished; its fields. TimeoutError (job cancelled) after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in FINISHED:
                return fields
            if time.monotonic() > deadline:
                self._run(["scancel", job_id], check=False)
                raise TimeoutError(f"job {job_id} not finished after {timeout} s: {fields}")
            time.sleep(1)

    def logs(self) -> str:
        """The tail of each daemon's log, for failure messages."""
        parts = []
        for name in ("slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"== {name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)
