"""The Slurm variables of a task's current run, for a process that may have been restored from a checkpoint.

A restored process keeps the environment it was captured with: its SLURM_RESTART_COUNT, SLURM_JOB_SLUID (a
new one every run since Slurm 25.11), SLURM_JOB_START_TIME, SLURMD_NODENAME... are the earlier run's, and so
is every copy a program made of them (Python's os.environ, a shell's variables). The task's slurmckpt wrapper
is what slurmstepd started for this run, with this run's environment: it is the restored tree's nearest
ancestor (the tree re-parents to it), whose initial environment carries the agent's fd variable that the
workload never gets (slurm/env.py PRIVATE). Read as the job's user, through the node's /proc (a GPU tree with
a /proc of its own sees no ancestor above its init, and gets an error).
"""
from __future__ import annotations

import os
from collections.abc import Iterator

from slurmckpt.node import procfs
from slurmckpt.errors import SlurmckptError

WRAPPER_MARK = "SLURMCKPT_AGENT_FD"        # set by the SPANK plugin for the wrapper, never in the workload's
PREFIXES = ("SLURM_", "SLURMD_")


def _ancestors(pid: int) -> Iterator[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        yield pid
        try:
            pid = int(procfs.status(pid)["PPid"][0])
        except (OSError, KeyError, IndexError, ValueError):
            return


def current_run(pid: int | None = None) -> dict[str, str]:
    """The SLURM_* and SLURMD_* variables of this run of the task that `pid` (default: the caller, as the
    node's /proc numbers it) belongs to, from its wrapper's environment."""
    if pid is None:
        pid = int(os.readlink(procfs.path("self")))
    mine = procfs.environ(pid)
    job = mine.get("SLURM_JOB_ID")
    for p in _ancestors(pid):
        env = procfs.environ(p)
        if WRAPPER_MARK in env and (job is None or env.get("SLURM_JOB_ID") == job):
            return {k: v for k, v in sorted(env.items()) if k.startswith(PREFIXES)}
    raise SlurmckptError("no slurmckpt wrapper among this process's ancestors (not a task of a checkpointed "
                         "job, or a tree with a /proc of its own)", pid=pid)
