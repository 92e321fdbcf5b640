"""What slurmctld says about jobs it still knows, in one `squeue -O` call for the CLI (no accounting, no JSON:
22.05's `squeue --json` ignores -j and -u and lists every job), and the state of one job for gc and the job's
end (`STATE_FIELDS`: asked with `-j N`, so slurmctld sends that job's record alone).

The fields are joined by a separator no Slurm name can hold; the comment fields come last (free text).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SEP = "\x1f"         # ASCII unit separator: squeue -O prints what follows ':' after each field
FIELDS = ("jobid", "arrayjobid", "arraytaskid", "username", "userid", "state", "restartcnt", "partition", "qos",
          "nodelist", "reqnodes", "reason", "admin_comment", "comment")


# Two fields no user writes. squeue's state word is Slurm's job_state_string(): a flag that says the job is
# still changing (COMPLETING, STAGE_OUT, REQUEUED, REQUEUE_HOLD, SPECIAL_EXIT...) takes the base state's
# place, so a word in store/reclaim.py's FINISHED is a job that has ended for good.
STATE_FIELDS = ("jobid", "state")


def format_arg(fields: tuple[str, ...] = FIELDS) -> str:
    return ",".join(f"{f}:{SEP}" for f in fields)


def parse_states(out: str) -> dict[int, str]:
    """`squeue -h -O format_arg(STATE_FIELDS)` output -> job id: state word; other lines are skipped."""
    states = {}
    for line in out.splitlines():
        values = line.split(SEP)
        if len(values) >= 2 and _int(values[0]) is not None and re.fullmatch(r"[A-Z_]+", values[1].strip()):
            states[int(values[0])] = values[1].strip()
    return states


@dataclass(frozen=True)
class QueuedJob:
    job_id: int
    array_job: int | None
    array_task: int | None
    user: str
    uid: int | None
    state: str
    restarts: int
    partition: str
    qos: str
    nodes: str
    req_nodes: str
    reason: str
    admin_comment: str
    comment: str

    @property
    def spec(self) -> str:
        """How Slurm's tools name it: `N_M` for an array task, else `N`."""
        return f"{self.array_job}_{self.array_task}" if self.array_task is not None else str(self.job_id)

    def slurmckpt_note(self) -> tuple[str, str]:
        """(field, slurmckpt's part of it) of the comment field it writes (slurm/comment.py); ("", "")."""
        return note_in({"AdminComment": self.admin_comment, "Comment": self.comment})


def note_in(fields: dict[str, str]) -> tuple[str, str]:
    for name, text in fields.items():
        if "slurmckpt:" in (text or ""):
            return name, "slurmckpt:" + text.split("slurmckpt:", 1)[1]
    return "", ""


def _int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def _text(text: str) -> str:
    text = text.strip()
    return "" if text in ("(null)", "N/A") else text


def parse(out: str) -> list[QueuedJob]:
    """`squeue -h -O format_arg()` output -> jobs. A line that does not parse (a field count that does not
    match) is skipped, not guessed at."""
    jobs = []
    for line in out.splitlines():
        values = line.split(SEP)[:-1] if line.endswith(SEP) else line.split(SEP)
        if len(values) < len(FIELDS) or _int(values[0]) is None:
            continue
        v = dict(zip(FIELDS, values))
        uid = re.search(r"\d+", v["userid"])
        jobs.append(QueuedJob(int(v["jobid"]), _int(v["arrayjobid"]) if _int(v["arraytaskid"]) is not None else None,
                              _int(v["arraytaskid"]), _text(v["username"]), int(uid.group(0)) if uid else None,
                              _text(v["state"]), _int(v["restartcnt"]) or 0, _text(v["partition"]), _text(v["qos"]),
                              _text(v["nodelist"]), _text(v["reqnodes"]), _text(v["reason"]),
                              _text(v["admin_comment"]), _text(SEP.join(values[len(FIELDS) - 1:]))))
    return jobs
