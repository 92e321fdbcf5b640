"""What the store and staging give back (docs/storage.md, "Garbage collection").

- Uncommitted epochs: an epoch directory the job manifest does not list, once its lease ran out (no rank
  works on it and its coordinator can no longer commit it: lease.py) or, without a lease, once untouched
  for GRACE_S. At every agent
  start and every capture (this job), and by `slurmckpt gc` (every job).
- Finished jobs: every image of a job Slurm says will not run again (COMPLETED, CANCELLED, FAILED, TIMEOUT,
  ...; never PENDING, REQUEUED or anything held), unless `keep_finished`. At the job's end (job_end.py,
  started by the SPANK plugin's job epilog) and by `slurmckpt gc` (admin, timer), only when slurmctld
  answered: a job it holds is judged by its state there (one word, squeue's: a flag such as COMPLETING or
  REQUEUED takes the base state's place, and is not final), accounting only speaks for jobs it no longer
  holds (slurm/control.py, job_states). PREEMPTED is final there: slurmctld shows a preempted job that is
  requeued as REQUEUED/PENDING, and only its accounting record says PREEMPTED. `verdict` is that one reading.
- Stores moved aside for another instance of a job id (`.stale-<job>-*`, instance.py): kept for the admins,
  listed by gc, never removed by slurmckpt.
- Staging: areas whose agent is gone. At agent start and by `slurmckpt gc`, on the node it runs on.
What a task leaves on its node besides (its task cgroups, its TCP holds) is rank/leftovers.py's, judged by
the same `verdict` and reported as the same `Removal`.
Removal renames first (under the job's lock, so no commit sees half a directory) and deletes after.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurmckpt.store import lease
from slurmckpt.store.durable import is_temp
from slurmckpt.errors import SlurmckptError, StorageError
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import TRASH, JobStore, epoch_of, list_jobs, tree_bytes

log = logging.getLogger("slurmckpt.reclaim")

GRACE_S = 3600.0
FINISHED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
                      "OUT_OF_MEMORY", "PREEMPTED", "REVOKED"})
# A job whose end slurmctld is still going through: its nodes' epilogs (22.05 says COMPLETING, 23.02+
# COMPLETED+COMPLETING or PENDING+COMPLETING+REQUEUED), a burst buffer's stage-out. Its state changes again,
# to a final one or back to PENDING.
SETTLING = frozenset({"COMPLETING", "STAGE_OUT"})


def verdict(state: str | None) -> str:
    """What Slurm's word on a job (slurm/control.py, `job_states`) says of its images: "finished" (it never
    runs again: they can go), "settling" (its end is under way: ask again), "unknown" (neither slurmctld nor
    accounting knows it) or "runs-again" (anything else: pending, requeued, held, running; they stay)."""
    if state is None:
        return "unknown"
    if SETTLING.intersection(state.split("+")):
        return "settling"
    return "finished" if state in FINISHED else "runs-again"


@dataclass(frozen=True)
class Removal:
    kind: str          # uncommitted-epoch | finished-job | staging | temp-file | task-cgroup | kept
    path: str
    bytes: int
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for entry in path.iterdir():
        newest = max(newest, entry.lstat().st_mtime)
    return newest


def _why_dead(epoch_dir: Path, now: float) -> str | None:
    """Why an uncommitted epoch directory can go, or None while its coordinator may still commit it."""
    try:
        expires = lease.expiry(epoch_dir)
    except FileNotFoundError:
        idle = now - _newest_mtime(epoch_dir)
        return f"uncommitted, no lease, untouched for {idle:.0f}s" if idle > GRACE_S else None
    except (OSError, ValueError):
        return "uncommitted, its lease is unreadable"
    return f"uncommitted, its lease ran out {now - expires:.0f}s ago" if expires < now else None


def collect_job(store: JobStore, dry_run: bool = False, now: float | None = None, wait: bool = False) -> list[Removal]:
    """This job's dead epochs and stale temp files. Nothing when its manifest cannot be read (what is
    committed is then unknown)."""
    if not store.job_dir.is_dir():
        return []
    now = lease.clock() if now is None else now
    out: list[Removal] = []
    try:
        with store.lock():
            committed = {e["epoch"] for e in store.read_manifest()["epochs"]}
            for entry in store.job_dir.iterdir():
                epoch = epoch_of(entry.name)
                if epoch is not None and epoch not in committed and entry.is_dir():
                    why = _why_dead(entry, now)
                    if why:
                        out.append(Removal("uncommitted-epoch", str(entry), tree_bytes(entry), why))
                        if not dry_run:
                            store.raise_counter(epoch)          # its number is never reused
                            store.to_trash(entry)
                elif is_temp(entry.name) and now - entry.lstat().st_mtime > GRACE_S:
                    out.append(Removal("temp-file", str(entry), entry.lstat().st_size, "a writer's leftover"))
                    if not dry_run:
                        entry.unlink()
    except (StorageError, FileNotFoundError):
        return out
    if not dry_run:
        store.empty_trash() if wait else store.empty_trash_later()
    return out


def collect_finished(root: Path, cluster: str, states: dict[int, str], keep_finished: bool,
                     dry_run: bool = False, summary_dir: str | None = None) -> list[Removal]:
    """Whole job stores of `cluster` whose job Slurm says is finished for good (`states` from
    slurm/control.py; a job Slurm does not know is kept and reported)."""
    out: list[Removal] = []
    for job_cluster, job in list_jobs(root):
        if job_cluster != cluster:
            continue
        store = JobStore(root, cluster, job)
        state = states.get(job)
        said = verdict(state)
        if said == "unknown":
            out.append(Removal("kept", str(store.job_dir), tree_bytes(store.job_dir),
                               "Slurm knows no such job (not in slurmctld, not in accounting)"))
        elif said == "finished":
            out.append(remove_finished(store, str(state), keep_finished, dry_run, summary_dir))
    return out


def remove_finished(store: JobStore, state: str, keep_finished: bool, dry_run: bool = False,
                    summary_dir: str | None = None) -> Removal:
    """The whole store of a job Slurm says is `state` (finished for good, `verdict`); its summary stays,
    saying when and why the images went. Images another instance of its id left (`.stale-<job>-*`) are not
    this job's: they stay for the admins (`collect_moved_aside`). Under the job's lock the summary is marked
    and the directory renamed, then deleted: of two removers (nodes, gc) one does it, the other finds
    nothing. Raises StorageError when the lock cannot be had."""
    size = tree_bytes(store.job_dir)
    if keep_finished:
        return Removal("kept", str(store.job_dir), size, f"job {state}; keep_finished is set")
    if not dry_run and not _remove_job(store, summary_dir, f"job {state}"):
        return Removal("finished-job", str(store.job_dir), 0, f"job {state}; already removed by another")
    return Removal("finished-job", str(store.job_dir), size, f"job {state}")


def collect_moved_aside(root: Path, cluster: str) -> list[Removal]:
    """Stores moved aside for another instance of their job id (instance.py): never restored, never removed
    by slurmckpt (they may be another user's images, or the trace of a lost slurmctld state), listed by gc
    so that the admins see them (docs/storage.md, "Garbage collection")."""
    directory = root / cluster
    found = sorted(directory.glob(".stale-*")) if directory.is_dir() else []
    return [Removal("kept", str(p), tree_bytes(p), "images of another instance of the job id, moved aside: kept "
                    "for the admins (never restored; remove by hand)") for p in found if p.is_dir()]


def _remove_job(store: JobStore, summary_dir: str | None, why: str) -> bool:
    trash = store.root / store.cluster / f"{TRASH}job-{store.job}-{time.time_ns()}"
    with store.lock():
        if not store.job_dir.is_dir():
            return False
        if summary_dir:
            _mark_summary(store, summary_dir, why)
        try:
            os.rename(store.job_dir, trash)
        except FileNotFoundError:
            return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _mark_summary(store: JobStore, summary_dir: str, why: str) -> None:
    """The job's user learns from its summary that the images are gone: republished for the uid the store
    is bound to (instance.py), with `images_removed`. A store without a binding, or a summary that cannot be
    written, only logs: the images go all the same."""
    from slurmckpt.store import summary
    from slurmckpt.store.instance import bound_uid
    uid = bound_uid(store)
    if uid is None:
        log.warning("job %d: its store names no owner; its summary is left as it was", store.job)
        return
    try:
        summary.publish(store, summary_dir, uid, removed={"at": time.time(), "why": why})
    except (SlurmckptError, OSError) as e:
        log.warning("job %d: its summary could not say that its images were removed: %s", store.job, e)


def collect_staging(staging: Staging, dry_run: bool = False, now: float | None = None) -> list[Removal]:
    out = []
    for area in staging.orphans(now):
        out.append(Removal("staging", str(area), tree_bytes(area), "its agent is gone"))
        if not dry_run:
            shutil.rmtree(area, ignore_errors=True)
            try:
                area.parent.rmdir()
            except OSError:
                pass
    return out


def collect_all(root: Path, cluster: str, states: dict[int, str], staging: Staging, keep_finished: bool,
                dry_run: bool = False, summary_dir: str | None = None) -> list[Removal]:
    """Everything `slurmckpt gc` does, in order: finished jobs, then dead epochs of the jobs left, then
    this node's orphaned staging areas, then trash left by interrupted deletions."""
    out = collect_finished(root, cluster, states, keep_finished, dry_run, summary_dir)
    for job_cluster, job in list_jobs(root):
        if job_cluster == cluster:
            out += collect_job(JobStore(root, cluster, job), dry_run, wait=True)
    out += collect_staging(staging, dry_run)
    out += collect_moved_aside(root, cluster)
    for trash in (root / cluster).glob(TRASH + "*") if (root / cluster).is_dir() else []:
        out.append(Removal("trash", str(trash), tree_bytes(trash), "an interrupted deletion"))
        if not dry_run:
            shutil.rmtree(trash, ignore_errors=True)
    return out
