"""slurmckpt's note on a job in Slurm: the job's AdminComment (or Comment, or nothing: `job_comment_field`),
which `scontrol show job` and `sacct -o AdminComment` show; its text, and how it reaches slurmctld. Who
writes it, and where the note and the checkpoint it shows are kept: store/job_comment.py.

The field holds one line: `slurmckpt: NOTE; last checkpoint: epoch N at TIME, SIZE` (either part alone when
the other is unknown). NOTE is the latest event worth an admin's eye (why the job started from the beginning,
a failed final capture: fresh_start.py); the checkpoint part is the newest commit. Text another tool put
before `slurmckpt:` is kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from slurmckpt.sizes import size_text

PREFIX = "slurmckpt:"
MAX_FIELD = 700                 # characters of the whole field (docs/contracts.md)

Write = Callable[[int, str, str], str]        # (job, field, text) -> the field that was set
Read = Callable[[int], dict[str, str]]         # job -> {field: current value}


def one_line(value: object, limit: int = 400) -> str:
    """Printable, one line, at most `limit` characters: every run of whitespace (newlines included) becomes
    one space, any other non-printable character (escape sequences, bidi controls) a '?'. The field carries
    text the job's user controls."""
    text = " ".join((value if isinstance(value, str) else str(value)).split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."



@dataclass(frozen=True)
class Checkpoint:
    epoch: int
    at: float
    size: int

    def describe(self) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.at))
        return f"last checkpoint: epoch {self.epoch} at {stamp}, {size_text(self.size)}"


def compose(note: str | None, checkpoint: Checkpoint | None, foreign: str = "") -> str:
    """The field's text. The note is cut, never the checkpoint part or another tool's text."""
    tail = checkpoint.describe() if checkpoint else ""
    head = f"{foreign} " if foreign else ""
    room = MAX_FIELD - len(head) - len(PREFIX) - 1 - (len(tail) + 2 if note and tail else len(tail))
    body = "; ".join(filter(None, [one_line(note, max(room, 20)) if note else "", tail]))
    return one_line(f"{head}{PREFIX} {body}", MAX_FIELD)


def foreign_part(current: str) -> str:
    """What another tool wrote in the field: everything before our prefix."""
    return current.split(PREFIX, 1)[0].strip()


def scontrol_write(job: int, field: str, text: str) -> str:
    from slurmckpt.slurm.control import CliSlurm
    return CliSlurm(timeout_s=20).annotate(job, text, field)


def scontrol_read(job: int) -> dict[str, str]:
    from slurmckpt.slurm.control import CliSlurm
    return CliSlurm(timeout_s=20).comments(job)
