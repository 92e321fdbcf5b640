"""What a task leaves on its node that none of its processes cleans up any more, and who takes it back
(docs/storage.md, "Garbage collection"); each judged by Slurm's word on the job (store/reclaim.py `verdict`)
and reported as a `Removal` like the store's.

- Task cgroups: ours, once empty, of the same task's earlier starts (their agent and watchdog died in
  slurmstepd's final SIGKILL before removing them) at agent start, and of finished jobs by `slurmckpt gc`.
- TCP holds (rank/sharing/netlock.py): a job's rule set in this node's packet filters. The job's end lifts
  them on every node (store/job_end.py, `lift_tcp_holds`); `slurmckpt gc` on the node it runs on lifts those
  of jobs Slurm says are finished or does not know.
"""
from __future__ import annotations

import logging
from pathlib import Path

from slurmckpt.identity import TreeName
from slurmckpt.node import packet_filter
from slurmckpt.node.packet_filter import PacketFilter
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.rank.sharing import netlock, rendezvous
from slurmckpt.store.reclaim import Removal, verdict

log = logging.getLogger("slurmckpt.reclaim")
end_log = logging.getLogger("slurmckpt.job_end")      # the job end's log, where its lift is said


def collect_task_cgroups(root: str, tree: TreeName) -> list[Removal]:
    """Empty cgroups of this task's earlier starts: thawed and removed. One that still holds a process is
    left as it is and reported (kind "kept"): what runs there is not this start's to end."""
    out = []
    for cgroup in TaskCgroup.earlier_runs(root, tree):
        if cgroup.pids():
            out.append(Removal("kept", str(cgroup.path), 0, f"an earlier start's cgroup still holds {cgroup.pids()}"))
            continue
        cgroup.remove()
        out.append(Removal("task-cgroup", str(cgroup.path), 0, "an earlier start's empty cgroup"))
    return out


def task_cgroup_jobs(root: str) -> list[int]:
    """The jobs that have a task cgroup of ours on this node."""
    return sorted({c.tree.job for c in TaskCgroup.all_ours(root)})


def collect_finished_task_cgroups(root: str, states: dict[int, str], dry_run: bool = False) -> list[Removal]:
    """This node's empty task cgroups of jobs Slurm says are finished for good: left when slurmstepd's
    final SIGKILL (scancel, time limit) ended the agent and its watchdog before either removed it. One that
    holds a process, or whose job Slurm does not know, is kept and reported."""
    out = []
    for cgroup in TaskCgroup.all_ours(root):
        state = states.get(cgroup.tree.job)
        if state is None:
            out.append(Removal("kept", str(cgroup.path), 0, "Slurm knows no such job"))
            continue
        if verdict(state) != "finished":
            continue
        if cgroup.pids():
            out.append(Removal("kept", str(cgroup.path), 0, f"job {state}, but it still holds {cgroup.pids()}"))
            continue
        if not dry_run:
            cgroup.remove()
        out.append(Removal("task-cgroup", str(cgroup.path), 0, f"job {state}"))
    return out


def tcp_hold_jobs(filters: list[PacketFilter], lock_dir: Path | None = None) -> set[int]:
    """The jobs with TCP holds on this node: a rule set in one of its packet filters, or their lock (they
    held some here once)."""
    jobs = rendezvous.locked_jobs(lock_dir or rendezvous.LOCK_DIR)
    for packets in filters:
        try:
            jobs |= packets.jobs()
        except OSError as e:
            log.warning("cannot list the TCP holds of %s: %s", packets.name, e)
    return jobs


def collect_tcp_holds(jobs: set[int], states: dict[int, str], filters: list[PacketFilter], dry_run: bool = False,
                      lock_dir: Path | None = None) -> list[Removal]:
    """The TCP holds of `jobs` on this node whose job Slurm says is finished or does not know: nothing of
    such a job can be restoring here."""
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    out = []
    for job in sorted(jobs):
        state = states.get(job)
        if verdict(state) not in ("finished", "unknown"):
            continue
        why = f"job {state}" if state else "Slurm knows no such job"
        if dry_run:
            counts = [_held_count(f, job) for f in filters]
            counts = [c for c in counts if c]
        else:
            counts = netlock.lift_job(job, filters, lock_dir)
            rendezvous.job_lock_path(lock_dir, job).unlink(missing_ok=True)
        out.append(Removal("tcp-hold", f"job {job}: " + ("; ".join(counts) or "no rule left"), 0, why))
    return out


def _held_count(packets: PacketFilter, job: int) -> str:
    try:
        count = len(packets.held(job).drops)
    except OSError as e:
        return f"{packets.name}: cannot be read ({e})"
    return f"{packets.name}: {count} rule(s)" if count else ""


def lift_tcp_holds(job: int) -> list[str]:
    """Every rule the job still has in this node's packet filters, and its markers (netlock.lift_job); only
    where the job ever held TCP on the node (it takes its lock there before any hold)."""
    if not rendezvous.job_lock_path(rendezvous.LOCK_DIR, job).exists():
        return []
    lifted = netlock.lift_job(job, packet_filter.installed())
    if lifted:
        end_log.log(logging.WARNING if any("FAILED" in line for line in lifted) else logging.INFO,
                    "job end: TCP holds left on this node lifted: %s", "; ".join(lifted))
    return lifted
