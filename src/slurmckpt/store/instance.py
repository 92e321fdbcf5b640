"""Images are bound to the job instance that wrote them.

A Slurm job id is unique only among the jobs slurmctld knows: after its state is lost or its id space wraps, a
new job (of any user) gets the id of an old one, and the old job's images are still in the store at
<root>/<cluster>/<job>. The agent therefore records, on the first write of a job's store, who wrote it:
cluster, job id, uid, gid (from slurmctld, by the trusted job id, cross-checked with the shim's argv) and
the job's SubmitTime. Every agent start and every commit claims the store again (`claim`): a store bound to
another instance is moved aside whole (to <root>/<cluster>/.stale-<job>-<ns>, root-only, kept for the admins)
and the new instance starts a fresh one; `mismatch` is what the agent's plan and restore check before any image
is offered or restored.

Slurm resets SubmitTime at every requeue (measured on 22.05: 11:07:19 -> 11:07:28 after `scontrol requeue`),
so the store keeps the SubmitTime of the run that first wrote it and a later run of the same instance
accepts it when its own SubmitTime is not earlier. What tells two instances of one id apart is run 0: a job
whose restart count is 0 was just submitted, so nothing in the store can be its own unless another rank of
this very run (same SubmitTime) bound it; anything else is moved aside then.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from slurmckpt.errors import StorageError
from slurmckpt.store.jobstore import JOB_MANIFEST, FORMAT_VERSION, JobStore


@dataclass(frozen=True)
class JobInstance:
    cluster: str
    job: int
    uid: int
    gid: int
    submit_time: str       # Slurm's SubmitTime of this run (ISO 8601 as scontrol prints it: sorts as text)
    restart_count: int

    def binding(self) -> dict[str, Any]:
        d = asdict(self)
        del d["restart_count"]
        return d


def mismatch(bound: object, me: JobInstance) -> str | None:
    """Why the store bound to `bound` (the manifest's "instance") is not this instance's, or None."""
    if not isinstance(bound, dict):
        return "the store carries no job-instance binding (written by an older slurmckpt or not by an agent)"
    for key in ("uid", "gid", "cluster", "job"):
        if bound.get(key) != getattr(me, key):
            return (f"its images were written by another job instance ({key} {bound.get(key)!r}, this job has "
                    f"{getattr(me, key)!r})")
    theirs = str(bound.get("submit_time", ""))
    if me.restart_count == 0 and theirs != me.submit_time:
        return (f"its images were written by an earlier job with the same id (submitted {theirs}; this job was "
                f"submitted {me.submit_time} and has never been requeued)")
    if theirs > me.submit_time:
        return f"its images were written by a job submitted later ({theirs}) than this one ({me.submit_time})"
    return None


def bound_uid(store: JobStore) -> int | None:
    """The uid the store is bound to, None when it holds no readable binding (reclaim.py and job_end.py:
    whose summary, whose job)."""
    try:
        bound = store.read_manifest().get("instance")
    except (StorageError, OSError):
        return None
    uid = bound.get("uid") if isinstance(bound, dict) else None
    return uid if type(uid) is int else None


@contextmanager
def store_lock(store: JobStore) -> Iterator[None]:
    """One claim at a time per job (ranks of a job start together): the job's POSIX lock (storage.py)."""
    with store.lock():
        yield


def _has_content(store: JobStore) -> bool:
    try:
        return any(p.name == JOB_MANIFEST or p.name.startswith("epoch-") for p in store.job_dir.iterdir())
    except FileNotFoundError:
        return False


def claim(store: JobStore, me: JobInstance, keep_epoch: int | None = None) -> str | None:
    """Make the job's store this instance's. Returns None when it already was (or was empty), else a message
    saying what was moved aside and why. `keep_epoch`: an epoch this instance is committing right now; its
    directory stays (its number is above every foreign one: next_epoch counted them)."""
    store.ensure()
    with store_lock(store):
        try:
            manifest = store.read_manifest()
            why = mismatch(manifest.get("instance"), me) if _has_content(store) else None
        except StorageError as e:
            manifest, why = {}, f"its manifest is unreadable ({e})"
        if why is None:
            if manifest.get("instance") is None:
                _write_binding(store, me, manifest, [])
            return None
        stale = store.root / store.cluster / f".stale-{store.job}-{time.time_ns()}"
        os.rename(store.job_dir, stale)
        store.ensure()
        if keep_epoch is not None and (stale / store.epoch_dir(keep_epoch).name).is_dir():
            os.rename(stale / store.epoch_dir(keep_epoch).name, store.epoch_dir(keep_epoch))
        note = (f"the image store of job {store.job} was not this job's: {why}; moved aside to {stale} "
                "(not restored; this job's own checkpoints start afresh)")
        _write_binding(store, me, {}, [{"at": time.time(), "why": note}])
        return note


def _write_binding(store: JobStore, me: JobInstance, manifest: dict[str, Any], moved: list[dict[str, Any]]) -> None:
    fresh = {"version": FORMAT_VERSION, "job": store.job, "cluster": store.cluster, "epochs": [],
             **manifest, "instance": me.binding()}
    fresh["moved_aside"] = [*manifest.get("moved_aside", []), *moved]
    store.write_manifest(fresh)


def moved_aside_notes(store: JobStore) -> list[str]:
    try:
        return [str(m.get("why", "")) for m in store.read_manifest().get("moved_aside", [])]
    except StorageError:
        return []

