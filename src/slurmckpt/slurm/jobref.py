"""A job named on the command line, parsed strictly.

`N` is job N; `N_M` is task M of array job N, which Slurm runs as a job of its own id (resolved through
squeue, cli/lookup.py, never guessed: Python's int("1234_5") is 12345, another user's job). Anything else is
refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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


def parse_job_spec(text: str) -> JobRef:
    m = _SPEC.fullmatch(text) if isinstance(text, str) else None
    if m is None or int(m.group(1)) > MAX_JOB_ID:
        raise BadJobSpec(f"{text!r} is not a job id: write N (a job) or N_M (task M of array job N)")
    return JobRef(int(m.group(1)), int(m.group(2)) if m.group(2) is not None else None)
