"""Which job a command names and what slurmckpt knows about it, fast: slurmctld first (one `squeue` call, which
also refuses an unknown job), accounting only where needed (a job slurmctld has forgotten; the submit line of a
running job with no run record yet) with short timeouts (docs/operations.md, "Command line")."""
from __future__ import annotations

import functools
import os
import re
import time
from typing import Any

import click

from slurmckpt.store import summary
from slurmckpt.cli.output import CliError, JobNotFoundError
from slurmckpt.config import Config, load_user_config
from slurmckpt.duration import parse_interval
from slurmckpt.errors import ConfigError, SlurmError
from slurmckpt.slurm.control import CliSlurm, JobUnknown
from slurmckpt.slurm.jobref import BadJobSpec, JobRef, parse_job_spec
from slurmckpt.slurm.plugstack import read_chain
from slurmckpt.slurm.queue import QueuedJob

SQUEUE_TIMEOUT_S = 10.0
SACCT_TIMEOUT_S = 5.0
ACCOUNTING_WAIT_S = 15.0     # for the submit line of a running job that just started (never for an unknown one)


class JobSpec(click.ParamType):  # type: ignore[type-arg]  # generic only in click's stubs of 8.2+, not at run time
    """`N` or `N_M` (array task), nothing else: int() would read `1234_5` as job 12345."""
    name = "JOB_ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> JobRef:
        if isinstance(value, JobRef):
            return value
        try:
            return parse_job_spec(value)
        except BadJobSpec as e:
            self.fail(str(e), param, ctx)


JOB = JobSpec()


def config() -> Config:
    try:
        return load_user_config()
    except ConfigError as e:
        raise CliError(str(e)) from e


@functools.lru_cache(maxsize=1)
def cluster() -> str:
    try:
        return CliSlurm(timeout_s=SQUEUE_TIMEOUT_S).cluster_name() or "cluster"
    except SlurmError:
        return "cluster"


def queued(ref: JobRef) -> QueuedJob:
    """The job slurmctld knows as `ref` (N, or N_M: its own id); JobNotFoundError like squeue's."""
    try:
        jobs = CliSlurm(timeout_s=SQUEUE_TIMEOUT_S).queued([str(ref)])
    except JobUnknown as e:
        raise JobNotFoundError(str(ref)) from e
    except SlurmError as e:
        raise CliError(str(e)) from e
    exact = [j for j in jobs if j.spec == str(ref) or (ref.task is None and j.job_id == ref.job)]
    if not exact:
        why = " (an array task that has not started has no job id yet)" if ref.task is not None and jobs else ""
        raise JobNotFoundError(f"{ref}{why}")
    return exact[0]


def require_owner(job: QueuedJob, what: str) -> None:
    """Before anything is sent: only the job's owner (or root). Slurm checks again."""
    if os.geteuid() != 0 and job.uid is not None and job.uid != os.getuid():
        raise CliError(f"refused: job {label(job)} belongs to uid {job.uid} ({job.user}), not to you "
                       f"(uid {os.getuid()}); nothing was {what}")


def label(job: QueuedJob) -> str:
    """The job's own id, and the array task's name where it has one: `1240 (1234_5)`."""
    return str(job.job_id) if job.spec == str(job.job_id) else f"{job.job_id} ({job.spec})"


def job_summary(cfg: Config, job_id: int) -> dict[str, Any] | None:
    """The job's summary (summary.py) if the caller may read it."""
    return summary.read(cfg.summary_dir, cluster(), job_id)


# ---- does the job run under slurmckpt? ----------------------------------------------------------------------
INTERVAL_OPTION = re.compile(r"""--checkpoint-interval(?:=|\s+)('[^']*'|"[^"]*"|\S+)""")


def interval_in(submit_line: str, batch_script: str) -> str | None:
    """The --checkpoint-interval a job was submitted with: the command line wins over #SBATCH lines (as in
    sbatch). None when neither names it."""
    found = INTERVAL_OPTION.findall(submit_line)
    for line in batch_script.splitlines():
        if line.startswith("#SBATCH"):
            found = found or INTERVAL_OPTION.findall(line)
        elif line.strip() and not line.startswith("#"):
            break                        # sbatch stops reading #SBATCH at the first command
    return found[-1].strip("'\"") if found else None


def interval_on(value: str | None) -> bool:
    """Whether a --checkpoint-interval value turns checkpointing on, by the shim's own grammar (duration.py):
    0 in any spelling it accepts (off, 0, 0s, 0m, 00:00, 0:00:00, 0h0m...) is off, and so is a value it would
    have refused (the job cannot run under slurmckpt with it); auto is on."""
    if value is None:
        return False
    try:
        return parse_interval(value) != 0
    except ValueError:
        return False


def submitted_interval(job_id: int, wait_s: float | None = None) -> tuple[str | None, bool]:
    """(what the job was submitted with, whether that is known): its submit line from accounting, asked once
    a second (short timeouts) until slurmdbd has it, at most `wait_s` (a job that just started may not be in
    accounting yet), then the #SBATCH lines of its script (slurmctld), which the command line overrides."""
    slurm = CliSlurm(timeout_s=SACCT_TIMEOUT_S)
    try:
        script = slurm.batch_script(job_id) or ""
    except SlurmError:
        script = ""
    deadline = time.monotonic() + (ACCOUNTING_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            submit_line = slurm.submit_line(job_id) or ""
        except SlurmError:
            submit_line = ""
        if submit_line or time.monotonic() >= deadline:      # the command line wins over #SBATCH: wait for it
            break
        time.sleep(1)
    found = interval_in(submit_line, script)
    return found, bool(found or submit_line)
def runs_under_slurmckpt(job: QueuedJob, cfg: Config) -> tuple[bool | None, str]:
    """(answer, how it is known). True when the job's batch step is wrapped (its capture signal is handled),
    False when it is not, None when it cannot be told yet. First the job's run record (written when the
    batch wrapper asked its agent for its plan: it handles the signal from then on); else what it was
    submitted with, else the plugin's default_interval= (a job with no option of its own is wrapped by it)."""
    info = job_summary(cfg, job.job_id)
    run = (info or {}).get("run") or {}
    if run and run.get("restart_count") == job.restarts:
        if run.get("disabled"):
            return False, f"checkpoints are disabled for it: {run['disabled']}"
        return True, "its batch step runs under slurmckpt"
    value, known = submitted_interval(job.job_id)
    if value is not None:
        return interval_on(value), f"submitted with --checkpoint-interval={value}"
    default = read_chain().default_interval()
    if default:
        return True, "enabled by the plugin's default_interval= in plugstack.conf"
    if known:
        return False, "it was not submitted with --checkpoint-interval, and the plugin has no default_interval="
    return None, "accounting has no submit line for it yet and its script names no --checkpoint-interval"
