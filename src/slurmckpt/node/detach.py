"""Root processes that outlive the job: a final capture's persister (store/final_persist.py) goes on after
Slurm's SIGKILL (docs/architecture.md, "The final capture and Slurm's SIGKILL").

Slurm's SIGKILL reaches every process in the job's cgroups (proctrack/cgroup signals the step's cgroup,
slurmstepd waits until it is empty, task/cgroup removes the job's cgroups at its end), and the agent that
starts such a process sits in them. So it leaves them as soon as it exists: in every cgroup v1 hierarchy it
moves to the hierarchy's root, in cgroup v2 to `slurmckpt/outlive` below the v2 mount (slurmckpt's own, beside
its freeze cgroups: seen and counted as slurmckpt's, never as a job's). It runs in a session of its own, with
a fixed environment, stdio on /dev/null (it logs to its own file) and no fd of the agent's.

Under proctrack/linuxproc or proctrack/pgid (which track by parentage and process group, not by cgroup) the
process stays a descendant of the task's wrapper until the wrapper ends, and Slurm's SIGKILL reaches it:
docs/limitations.md.
"""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Callable, Protocol

from slurmckpt.node import procfs
from slurmckpt.node.task_cgroup import cgroup_mounts

log = logging.getLogger("slurmckpt.detach")

OWN_V2 = ("slurmckpt", "outlive")          # below the cgroup v2 mount
FIXED_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class Detached(Protocol):
    """A started process as its starter holds it (subprocess.Popen, or a test's stand-in)."""
    pid: int

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


Spawn = Callable[[list[str], dict[str, str]], Detached]


def destinations(pid: int) -> list[Path]:
    """The cgroup.procs files that take `pid` out of every cgroup it is in below a hierarchy's root."""
    mounts = cgroup_mounts()
    out = []
    for _, controllers, path in procfs.cgroups(pid):
        mount = mounts.get(controllers or "0::")
        if mount is None:
            continue
        if not controllers:                      # cgroup v2
            target = mount.joinpath(*OWN_V2)
            if path.strip("/") != "/".join(OWN_V2):
                out.append(target / "cgroup.procs")
        elif path != "/":
            out.append(mount / "cgroup.procs")
    return out


def leave_job_cgroups(pid: int) -> list[str]:
    """Move `pid` out of the job's cgroups (see above). Returns what failed ([] all moved): a process that
    stays in one may die with the job, which the caller says."""
    failed = []
    for procs in destinations(pid):
        try:
            procs.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            procs.write_text(str(pid))
        except OSError as e:
            failed.append(f"{procs.parent}: {e.strerror or e}")
    if failed:
        log.warning("pid %d did not leave every cgroup of the job: %s", pid, "; ".join(failed))
    return failed


def spawn(argv: list[str], extra_env: dict[str, str] | None = None) -> Detached:
    """Start `argv` as root in a session of its own outside the job's cgroups (the caller keeps the Popen:
    it may stop the process while the epoch is still its own, e.g. an abort). Raises OSError."""
    env = {**FIXED_ENV, **(extra_env or {})}
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True, cwd="/")
    failed = leave_job_cgroups(proc.pid)
    if failed:
        proc.kill()
        proc.wait()
        raise OSError(f"could not move the process out of the job's cgroups: {'; '.join(failed)}")
    return proc
