"""A job named on the command line: parsed strictly, resolved through Slurm to its job id and owner.

`N` is job N; `N_M` is task M of array job N, which Slurm runs as a job of its own id (resolved here, never
guessed: Python's int("1234_5") is 12345, another user's job). Anything else is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from slurmckpt.errors import SlurmError

_SPEC = re.compile(r"([1-9][0-9]{0,9})(?:_(0|[1-9][0-9]{0,6}))?")
MAX_JOB_ID = 2**32 - 1


class BadJobSpec(ValueError):
    pass


@dataclass(frozen=True)
class JobRef:
    job: int                    # as written: the job, or the array job for N_M
    task: int | None = None     # the array task, for N_M

    def __str__(self) -> str:
        return f"{self.job}_{self.task}" if self.task is not None else str(self.job)


@dataclass(frozen=True)
class JobInfo:
    job_id: int                 # the job Slurm runs (an array task's own id)
    uid: int
    spec: JobRef


def parse_job_spec(text: str) -> JobRef:
    m = _SPEC.fullmatch(text) if isinstance(text, str) else None
    if m is None or int(m.group(1)) > MAX_JOB_ID:
        raise BadJobSpec(f"{text!r} is not a job id: write N (a job) or N_M (task M of array job N)")
    return JobRef(int(m.group(1)), int(m.group(2)) if m.group(2) is not None else None)


def _fields(line: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


def _uid(user_id: str) -> int | None:
    """scontrol's `UserId=name(1001)`."""
    m = re.fullmatch(r"[^()]*\((\d+)\)", user_id)
    return int(m.group(1)) if m else None


def from_scontrol(ref: JobRef, out: str) -> JobInfo | None:
    """The record that is exactly `ref` in `scontrol -o show job` output (one job per line)."""
    for line in out.splitlines():
        f = _fields(line)
        uid = _uid(f.get("UserId", ""))
        if uid is None or not f.get("JobId", "").isdigit():
            continue
        if ref.task is None and f["JobId"] == str(ref.job):
            return JobInfo(int(f["JobId"]), uid, ref)
        if (ref.task is not None and f.get("ArrayJobId") == str(ref.job)
                and f.get("ArrayTaskId") == str(ref.task)):
            return JobInfo(int(f["JobId"]), uid, ref)
    return None


def from_sacct(ref: JobRef, out: str) -> JobInfo | None:
    """The same from `sacct -n -X -P -o JobIDRaw,JobID,UID` (jobs slurmctld has forgotten)."""
    for line in out.splitlines():
        raw, _, rest = line.partition("|")
        shown, _, uid = rest.partition("|")
        if not (raw.isdigit() and uid.strip().isdigit()):
            continue
        if (ref.task is None and raw == str(ref.job)) or (ref.task is not None and shown == str(ref)):
            return JobInfo(int(raw), int(uid), ref)
    return None


def resolve(ref: JobRef, run) -> JobInfo:
    """`run(*cmd) -> stdout` (CliSlurm._run). Raises SlurmError when Slurm knows no such job."""
    try:
        found = from_scontrol(ref, run("scontrol", "-o", "show", "job", str(ref)))
    except SlurmError:          # not (or no longer) known to slurmctld
        found = None
    if found is None:
        try:
            found = from_sacct(ref, run("sacct", "-n", "-X", "-P", "-j", str(ref), "-o", "JobIDRaw,JobID,UID"))
        except SlurmError:
            found = None
    if found is None:
        why = " (an array task that has not started has no job id yet)" if ref.task is not None else ""
        raise SlurmError(f"Slurm knows no job {ref}{why}")
    return found
