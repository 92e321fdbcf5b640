"""Who a task is: built once from Slurm's word (the SPANK shim's argv) and passed around as a value.

A rank's name, `step.rank` (`RankName`), keys its images in the store, its record in a job manifest and its
connection at the coordinator; it is written in `RankName.__str__` and read in `validate.rank_name`.
A tree's name, `job.step.rank.restart`, labels its cgroup (task_cgroup.py) and keys node-wide restore state
(netlock.py). It is written in one place (`TreeName.__str__`) and read back in one place (`TreeName.parse`),
where a name comes from outside this process: another task's cgroup on the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class RankName(NamedTuple):
    """One rank of a job across its restarts (a tuple: `step, rank = name` unpacks it)."""
    step: str            # "batch" or a step number
    rank: int

    def __str__(self) -> str:
        return f"{self.step}.{self.rank}"


@dataclass(frozen=True)
class TreeName:
    """One start of one task's process tree."""
    job: int
    step: str            # "batch" or a step number
    rank: int
    restart: int         # Slurm's restart count of the job at this start

    def __str__(self) -> str:
        return f"{self.job}.{self.step}.{self.rank}.{self.restart}"

    @property
    def task(self) -> str:
        """job.step.rank: the task across restarts (log files, the namespace init's home)."""
        return f"{self.job}.{self.step}.{self.rank}"

    @property
    def rank_name(self) -> RankName:
        return RankName(self.step, self.rank)

    @property
    def label(self) -> str:
        """How messages name the task to a user."""
        return f"job {self.job} step {self.step} rank {self.rank}"

    @classmethod
    def parse(cls, text: str) -> TreeName | None:
        """The name another task's cgroup carries; None if it is not one of ours."""
        parts = text.split(".")
        if len(parts) != 4 or not parts[0].isdigit() or not parts[2].isdigit() or not parts[3].isdigit():
            return None
        if parts[1] != "batch" and not parts[1].isdigit():
            return None
        return cls(int(parts[0]), parts[1], int(parts[2]), int(parts[3]))


@dataclass(frozen=True)
class TaskIdentity:
    """Trusted: from the SPANK shim's argv (job, step, rank, uid, gid) and slurmctld (restart count)."""
    cluster: str
    job: int
    step: str
    rank: int
    uid: int
    gid: int
    restart_count: int

    @property
    def tree(self) -> TreeName:
        return TreeName(self.job, self.step, self.rank, self.restart_count)
