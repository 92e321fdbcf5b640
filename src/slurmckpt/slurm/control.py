"""Job control behind one interface: the CLI backend (scontrol/squeue/sacct, always present) and pyslurm
when it is installed and built for the running Slurm's major version."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from typing import Protocol

from slurmckpt.errors import SlurmError

log = logging.getLogger("slurmckpt.slurm")


class SlurmControl(Protocol):
    def requeue(self, job_id: int) -> None: ...
    def end_time(self, job_id: int) -> float | None: ...
    def job(self, job_id: int) -> dict: ...


class CliSlurm:
    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def _run(self, *cmd: str) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"{cmd[0]} failed: {e}", command=" ".join(cmd)) from e
        if p.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def requeue(self, job_id: int) -> None:
        start = time.monotonic()
        self._run("scontrol", "requeue", str(job_id))
        log.info("requeued job %d in %.2fs", job_id, time.monotonic() - start)

    def job(self, job_id: int) -> dict:
        data = json.loads(self._run("squeue", "--json", "-j", str(job_id)))
        jobs = [j for j in data.get("jobs", []) if j.get("job_id") == job_id]
        if not jobs:
            raise SlurmError("job not found in squeue", job=job_id)
        return jobs[0]

    def end_time(self, job_id: int) -> float | None:
        job = self.job(job_id)
        end, limit = job.get("end_time"), job.get("time_limit")
        if isinstance(end, dict):                 # newer Slurm: {"set":..,"infinite":..,"number":..}
            end = end.get("number") if end.get("set") and not end.get("infinite") else None
        if isinstance(limit, dict):
            limit = None if limit.get("infinite") else limit.get("number")
        if not end or limit in (None, 0, 4294967295):
            return None
        return float(end)


class PyslurmControl:
    """Used only when pyslurm matches the running Slurm (PyPI has builds for 25.11 only)."""

    def __init__(self) -> None:
        import pyslurm  # noqa: F401 - availability check
        self.pyslurm = pyslurm

    def requeue(self, job_id: int) -> None:
        self.pyslurm.Job(job_id).requeue()

    def job(self, job_id: int) -> dict:
        return self.pyslurm.Job.load(job_id).to_dict()

    def end_time(self, job_id: int) -> float | None:
        job = self.pyslurm.Job.load(job_id)
        return float(job.end_time) if job.end_time and job.time_limit else None


def slurm_major() -> str | None:
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=10).stdout
        return ".".join(out.split()[1].split(".")[:2])
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def default_control() -> SlurmControl:
    try:
        import pyslurm
        if slurm_major() and str(getattr(pyslurm, "__version__", "")).startswith(slurm_major() or "-"):
            return PyslurmControl()
    except ImportError:
        pass
    if shutil.which("scontrol") is None:
        raise SlurmError("scontrol not found: Slurm client tools are required")
    return CliSlurm()
