"""The time Slurm gives a job between its SIGTERM and its SIGKILL (docs/operations.md, "The time Slurm gives
a final capture"), read from the admin's configuration.

- `scontrol requeue`, `scancel`, a time limit: SIGCONT + SIGTERM, then SIGKILL after KillWait (slurm.conf;
  default 30 s) to every process in the job's cgroups; slurmd waits at least 5 s (`_rpc_terminate_job`:
  `MAX(kill_wait, 5)`), so a KillWait below that gives 5 s.
- Preemption with PreemptMode=REQUEUE (or CANCEL): the signal at once, SIGKILL after GraceTime + KillWait.
  Whose GraceTime follows PreemptType (slurmctld's preempt plugins, `_get_grace_time`): the job's partition
  for preempt/partition_prio, its QOS for preempt/qos; none for preempt/none.

What is parsed here is written by the admin (slurm.conf, the partition's and the QOS's records); no field a
job's user chooses is read. `scontrol show config`, `scontrol show partition -o` and `sacctmgr -P` are the
forms every release from 22.05 on has (22.05 has no `--json` for any of them), run by slurm/control.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_KILL_WAIT_S = 30          # Slurm's default KillWait
SLURMD_MIN_WAIT_S = 5             # slurmd's terminate waits at least this long for the job's processes
MAX_S = 2**32 - 2                 # above Slurm's own limits (KillWait: uint16; a QOS's GraceTime: uint32)


@dataclass(frozen=True)
class KillWindow:
    """Seconds from Slurm's SIGTERM to its SIGKILL for one job."""
    kill_wait_s: int = DEFAULT_KILL_WAIT_S
    grace_s: int = 0                  # GraceTime that applies when the job is preempted
    grace_from: str = ""              # "partition low", "QOS normal" ("" none applies)
    known: bool = True                # False: Slurm could not be asked; its default KillWait is assumed

    def seconds(self, preempted: bool) -> int:
        return max(self.kill_wait_s, SLURMD_MIN_WAIT_S) + (self.grace_s if preempted else 0)

    def describe(self, preempted: bool) -> str:
        """`30 s (KillWait)`, `60 s (GraceTime 30 s of partition low + KillWait 30 s)`."""
        unknown = "" if self.known else ", Slurm's default: scontrol did not answer"
        kill = f"KillWait {self.kill_wait_s} s" if preempted and self.grace_s else "KillWait"
        if self.kill_wait_s < SLURMD_MIN_WAIT_S:
            kill = f"KillWait {self.kill_wait_s} s, and slurmd waits at least {SLURMD_MIN_WAIT_S} s"
        if preempted and self.grace_s:
            return f"{self.seconds(True)} s (GraceTime {self.grace_s} s of {self.grace_from} + {kill}{unknown})"
        return f"{self.seconds(False)} s ({kill}{unknown})"

    def as_dict(self) -> dict[str, object]:
        return {"kill_wait_s": self.kill_wait_s, "grace_s": self.grace_s, "grace_from": self.grace_from,
                "known": self.known}


def config_values(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key                = value` lines -> {Key: value}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def seconds_field(value: str, what: str) -> int:
    """`30 sec`, `30`, `00:00:30`, `1-00:00:00`, `UNLIMITED`/`N/A`/empty (0) -> seconds. ValueError otherwise."""
    text = value.strip()
    if text in ("", "N/A", "NONE", "(null)"):
        return 0
    m = re.fullmatch(r"(\d+)(?: ?sec)?", text)
    if m:
        return _bounded(int(m.group(1)), what)
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if m:
        days, hours, minutes, secs = (int(g or 0) for g in m.groups())
        return _bounded(((days * 24 + hours) * 60 + minutes) * 60 + secs, what)
    raise ValueError(f"{what}: {value[:40]!r} is no number of seconds")


def _bounded(seconds: int, what: str) -> int:
    if seconds > MAX_S:
        raise ValueError(f"{what}: {seconds} s is above Slurm's limit")
    return seconds


def partition_grace(line: str) -> int:
    """GraceTime of `scontrol show partition -o NAME`'s one line (seconds; 0 when it has none)."""
    m = re.search(r"(?:^|\s)GraceTime=(\S+)", line)
    return seconds_field(m.group(1), "GraceTime") if m else 0


def partition_graces(text: str) -> dict[str, int]:
    """`scontrol show partition -o` (every partition, one line each) -> {name: GraceTime seconds}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"PartitionName=(\S+)", line.strip())
        if m:
            out[m.group(1)] = partition_grace(line)
    return out


def qos_grace(text: str, qos: str) -> int:
    """GraceTime of `qos` in `sacctmgr -n -P show qos format=Name,GraceTime` (0 when it is not listed)."""
    for row in text.splitlines():
        name, _, grace = row.partition("|")
        if name.strip() == qos:
            return seconds_field(grace, "GraceTime")
    return 0


def grace_source(preempt_type: str, partition: str, qos: str) -> str:
    """Whose GraceTime applies under `preempt_type` ("" none): `partition NAME` or `QOS NAME`."""
    kind = preempt_type.strip().removeprefix("preempt/")
    if kind == "partition_prio" and partition:
        return f"partition {partition}"
    if kind == "qos" and qos:
        return f"QOS {qos}"
    return ""
