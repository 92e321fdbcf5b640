"""Slurm's task cgroup on a pure cgroup v2 host (Slurm's cgroup/v2 plugin), found and checked by root.

Slurm's v2 layout is `<job>/<step>/{slurm,user/<task>}` below its own root (22.05 to 26.05; the job cgroup
is `job_<id>` before 26.05 and named by SLUID since: nothing here reads a name). Slurm's proctrack/cgroup
lists, signals and waits for the pids of `<step>/slurm` and of each `<task>` cgroup itself, not of their
children (`cgroup_p_step_get_pids`), and rmdirs the task cgroups at the end of the step. The tree therefore
stays in the task cgroup itself, which becomes its freeze cgroup (`cgroup.freeze` works in any v2 cgroup;
Slurm's suspend freezes `<step>/user`, an ancestor: the two compose), and the wrapper, the agent and its
watchdog move to slurmstepd's own cgroup `<step>/slurm`, which Slurm lists and signals too
(docs/architecture.md, "cgroup v2").
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("slurmckpt.cgroup")

LABEL = "trusted.slurmckpt.task"      # job.step.rank.restart of the tree in a task cgroup (root-only xattr)


@dataclass(frozen=True)
class TaskPlacement:
    task: Path       # Slurm's task cgroup of the wrapper: the tree's cgroup and freeze cgroup
    stepd: Path      # slurmstepd's cgroup of the same step: the wrapper, agent and watchdog go here


def _v2_path(pid: int, proc: Path) -> str | None:
    """The cgroup v2 path of `pid` ("0::/x/y" line), None without one."""
    with open(proc / str(pid) / "cgroup") as f:
        for line in f.read().splitlines():
            if line.startswith("0::"):
                return line[3:]
    return None


def _parent_and_uid(pid: int, proc: Path) -> tuple[int, int]:
    ppid = uid = -1
    with open(proc / str(pid) / "status") as f:
        for line in f:
            if line.startswith("PPid:"):
                ppid = int(line.split()[1])
            elif line.startswith("Uid:"):
                uid = int(line.split()[1])
    return ppid, uid


def find(wrapper_pid: int, mount: Path, proc: Path = Path("/proc")) -> TaskPlacement | None:
    """Slurm's task cgroup of the wrapper and slurmstepd's cgroup of its step, or None where the wrapper
    is in no Slurm task cgroup (no cgroup/v2 plugin, proctrack/linuxproc with task/none). Checked, not
    taken on trust: the wrapper's parent is a root process (slurmstepd) whose cgroup is the sibling of the
    task cgroup's parent (`<step>/slurm` next to `<step>/user`), and both of those directories are root's.
    Slurm chowns the task cgroup itself to the job's user (who may create cgroups below it), but a user
    cannot create a directory in root's `<step>/user`, so a path of that shape is Slurm's."""
    try:
        rel = _v2_path(wrapper_pid, proc)
        ppid, _ = _parent_and_uid(wrapper_pid, proc)
        stepd_rel = _v2_path(ppid, proc) if ppid > 0 else None
        _, stepd_uid = _parent_and_uid(ppid, proc) if ppid > 0 else (0, -1)
    except (OSError, ValueError):
        return None
    if not rel or not stepd_rel or stepd_uid != 0 or rel == "/" or ".." in rel.split("/"):
        return None
    task, stepd = mount / rel.lstrip("/"), mount / stepd_rel.lstrip("/")
    if task.parent.parent != stepd.parent or task.parent == stepd or task.parent.parent == mount:
        log.info("wrapper's cgroup %s is no Slurm task cgroup next to slurmstepd's %s", rel, stepd_rel)
        return None
    try:
        if any(os.stat(d, follow_symlinks=False).st_uid != 0 for d in (task.parent, stepd)) or not task.is_dir():
            return None
    except OSError:
        return None
    return TaskPlacement(task, stepd)


def label(task: Path, name: str) -> None:
    """Mark Slurm's task cgroup as holding the tree `name`, so that the job's other trees on this node
    find it (`job_tasks`). Best effort: without xattrs the capture's checks see no peer trees (logged)."""
    try:
        os.setxattr(task, LABEL, name.encode())
    except OSError as e:
        log.warning("cannot label %s as %s (%s): the job's other trees on this node will not see it", task,
                    name, e.strerror)


def label_of(task: Path) -> str | None:
    try:
        return os.getxattr(task, LABEL).decode()
    except (OSError, UnicodeDecodeError):
        return None


def job_tasks(task: Path) -> dict[Path, str]:
    """The labelled task cgroups of this job on this node other than `task`: every `<step>/user/<task>`
    below the job cgroup (three levels up), -> the tree name in its label."""
    job = task.parent.parent.parent
    out: dict[Path, str] = {}
    try:
        candidates = [t for s in job.iterdir() if s.is_dir() for u in s.iterdir() if u.is_dir()
                      for t in u.iterdir() if t.is_dir()]
    except OSError:
        return out
    for t in candidates:
        name = label_of(t) if t != task else None
        if name:
            out[t] = name
    return out
