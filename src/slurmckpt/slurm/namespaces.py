"""The user and PID namespaces Slurm may make for a job (namespace/linux, Slurm 25.11 on; docs/slurm-versions.md,
"Slurm 25.11 and 26.05"), seen from the task's wrapper when its agent starts.

namespace.yaml's `clone_ns_flags: [CLONE_NEWUSER, CLONE_NEWPID]` (25.11's namespace.conf: CloneNSFlags=) makes
every job a user and/or a PID namespace of its own, a new one each run, and slurmstepd runs the job's steps in
them. criu would then run inside the job's user namespace, without the node's privileges, and restore into a
namespace the next run makes afresh: slurmckpt does not checkpoint such a job. The agent refuses it at the start,
naming the setting, and the wrapper runs the task plainly: nothing is ever frozen. Read from /proc, whatever
file configured it (the setting's file and format changed between 25.11 and 26.05):
- user: the kernel numbers its initial user namespace with a fixed inode (PROC_USER_INIT_INO); a node, a
  container or slurmckpt's own test roots without a user namespace of their own all show it.
- PID: the task's PID namespace is nested below the one /proc shows (more than one NSpid); or its parent,
  slurmstepd, is outside it (PPid 0); or /proc is the job's own (namespace/linux mounts one, whose init is the
  slurmstepd that holds the job's namespaces, "slurmstepd: [JOB:namespace]"). slurmckpt's own PID namespace
  is made below the wrapper, so the wrapper never is in it.
"""
from __future__ import annotations

from slurmckpt.node import procfs

INIT_USER_NS = 0xEFFFFFFD          # PROC_USER_INIT_INO (include/linux/proc_ns.h), the same on every kernel
SLURM_NS_HOLDER = "slurmstepd"     # the namespace/linux job's init (argv "slurmstepd: [JOB:namespace]")


def _own_user_namespace(pid: int) -> bool:
    return procfs.namespace_link(pid, "user") != INIT_USER_NS


def _own_pid_namespace(pid: int) -> bool:
    status = procfs.status(pid)
    nested = len(status.get("NSpid", [])) > 1           # /proc shows a PID namespace above the task's
    parent_outside = status.get("PPid") == ["0"]         # slurmstepd, its parent, is outside the task's
    holder = procfs.cmdline(1)[:1]                       # /proc is the job's: its init is Slurm's holder
    return nested or parent_outside or (bool(holder) and holder[0].startswith(SLURM_NS_HOLDER))


def job_namespace_refusal(task_pid: int) -> str | None:
    """Why the task whose wrapper is `task_pid` is not checkpointed (its job's own user and/or PID
    namespace, by the setting that makes them); None for a task in the node's."""
    flags = [flag for flag, own in (("CLONE_NEWUSER", _own_user_namespace), ("CLONE_NEWPID", _own_pid_namespace))
             if own(task_pid)]
    if not flags:
        return None
    kinds = " and ".join("a user" if f == "CLONE_NEWUSER" else "a PID" for f in flags)
    return (f"the job runs in {kinds} namespace of its own (NamespaceType=namespace/linux with clone_ns_flags "
            f"{', '.join(flags)} in namespace.yaml): slurmckpt cannot restore a job into the namespaces Slurm "
            "makes afresh for each run, so it does not checkpoint it (docs/limitations.md)")
