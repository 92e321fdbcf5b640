"""A final capture's images after Slurm's SIGKILL (docs/storage.md, "The final capture and Slurm's SIGKILL").

A final capture must end inside the window Slurm gives (KillWait; GraceTime + KillWait for a preemption).
What has to end there is each rank's dump into its node's staging; the persist into the shared store, its
seal and the commit come after, in a root process per rank outside the job's cgroups (store/final_persist.py,
started by the rank's agent: node/detach.py), which Slurm's SIGKILL does not reach. The coordinator, by then
perhaps dead too, cannot commit such an epoch, so the commit is decided here, in the job's store, under the
job's lock:

- `pend` (the coordinator's agent, once every rank of the final epoch dumped and handed over, still inside the
  window): the epoch's record goes into the manifest's `pending` list: its ranks (the records a commit takes),
  reason, run (fenced: refused to a run older than the store's, like any commit) and keep-N.
- `complete` (each persister after its rank's rank.json, `pend` itself, and the next run's agents): when every
  image rank of a pending epoch is sealed, the epoch is committed (`JobStore.commit(handed_over=True)`: the
  fence is the pending record, written while its run was the store's; the next run waits for it, see below).
  Whoever comes last commits; the lock makes it once.
- `abandon`: a pending epoch that will not complete (a persister failed, or stopped: its heartbeat ran out;
  or it took longer than the next run would wait) is withdrawn (`rejected`, never committed later) and the
  reason recorded as the final capture's failure (fresh_start.py): the previous commit stays the newest.
- `settle` (the next run's agents, before they plan a restore): every pending epoch is committed or abandoned
  first, waiting while its persisters are alive (heartbeat: `.lease-persist-<step>.<rank>`, renewed every
  HEARTBEAT_EVERY_S). So a restore never starts from an older epoch while a newer final one is on its way,
  and an old run's final epoch never commits after the new run restored something else.
A node that crashes mid-persist leaves a rank without rank.json: never committed; the previous commit stays.

`began` records the newest final epoch begun (`final-epoch.json`), so that the next run can tell what a
requeue cost even when Slurm's SIGKILL came before anything was recorded (`requeue_cost`).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from slurmckpt import validate
from slurmckpt.errors import StorageError
from slurmckpt.slurm.comment import one_line
from slurmckpt.store import fresh_start, lease
from slurmckpt.store.durable import atomic_write_json
from slurmckpt.store.jobstore import RANK_MANIFEST, JobStore, fenced

log = logging.getLogger("slurmckpt.handover")

PENDING = "pending"
BEGUN_FILE = "final-epoch.json"
HEARTBEAT = "persist-"                # lease holder of a rank's persister: .lease-persist-<step>.<rank>
HEARTBEAT_EVERY_S = 5.0
HEARTBEAT_S = 30.0                    # a persister not heard of for this long is gone
POLL_S = 1.0


def pending(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    entries = manifest.get(PENDING)
    return [p for p in entries if isinstance(p, dict) and type(p.get("epoch")) is int] \
        if isinstance(entries, list) else []


def _image_ranks(entry: dict[str, Any]) -> list[str]:
    ranks = entry.get("ranks")
    return sorted(n for n, r in ranks.items() if isinstance(r, dict) and r.get("kind") in ("image", "replay")) \
        if isinstance(ranks, dict) else []


def _sealed(store: JobStore, epoch: int, name: str) -> bool:
    step, rank = validate.rank_name(name)
    return (store.rank_dir(epoch, step, rank) / RANK_MANIFEST).is_file()


# ---- the final epoch's life --------------------------------------------------------------------------------
def began(store: JobStore, epoch: int, run: int) -> None:
    """A final epoch was allocated (the coordinator's agent, at the trigger: Slurm's SIGTERM has just come)."""
    atomic_write_json(store.job_dir / BEGUN_FILE, {"epoch": epoch, "at": time.time(), "run": run})


def begun(store: JobStore) -> dict[str, Any] | None:
    try:
        data = json.loads((store.job_dir / BEGUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and type(data.get("epoch")) is int and isinstance(data.get("at"), (int, float))
    return data if ok else None


def pend(store: JobStore, epoch: int, ranks: dict[str, dict[str, Any]], reason: str, run: int | None,
         keep: int) -> bool:
    """Every rank of final `epoch` dumped and handed its images to a persister: recorded for the commit.
    Returns whether the epoch is committed already (every rank sealed before this)."""
    with store.lock():
        manifest = store.read_manifest()
        fenced(manifest, run, epoch, "the final capture's hand-over")
        if any(r.get("epoch") == epoch for r in manifest.get("rejected", [])):
            raise StorageError("epoch was withdrawn; it is never committed", epoch=epoch)
        manifest[PENDING] = [p for p in pending(manifest) if p["epoch"] != epoch] + [
            {"epoch": epoch, "ranks": ranks, "reason": reason, "run": run, "keep": keep, "at": time.time()}]
        store.write_manifest(manifest)
        return complete(store, epoch)


def complete(store: JobStore, epoch: int) -> bool:
    """Commit pending `epoch` if every image rank of it is sealed in the store. Whether it is committed now
    (False: not pending, or ranks still missing)."""
    with store.lock():
        entry = next((p for p in pending(store.read_manifest()) if p["epoch"] == epoch), None)
        if entry is None or not all(_sealed(store, epoch, name) for name in _image_ranks(entry)):
            return False
        store.commit(epoch, entry["ranks"], str(entry.get("reason", "sigterm")), int(entry.get("keep", 2)),
                     run=entry.get("run"), handed_over=True)
        log.info("committed final epoch %d of job %d: every rank's images are in the store", epoch, store.job)
        return True


def abandon(store: JobStore, epoch: int, why: str, rank: str = "") -> bool:
    """Pending `epoch` will not complete: withdrawn for good (a persister finishing later commits nothing),
    and recorded as the final capture's failure. Whether it was still pending."""
    with store.lock():
        manifest = store.read_manifest()
        entry = next((p for p in pending(manifest) if p["epoch"] == epoch), None)
        if entry is None:
            return False
        manifest[PENDING] = [p for p in pending(manifest) if p["epoch"] != epoch]
        manifest.setdefault("rejected", []).append({"epoch": epoch, "at": time.time(),
                                                    "reason": f"the final capture's images did not reach the "
                                                              f"store: {why}"[:500]})
        store.write_manifest(manifest)
    fresh_start.record(store, fresh_start.CaptureFailure(
        epoch, time.time(), rank, "", True, str(entry.get("reason", "sigterm")), "persist",
        one_line(f"its images did not reach the store after the job ended: {why}"), "agent"))
    log.warning("final epoch %d of job %d abandoned: %s", epoch, store.job, why)
    return True


def heartbeat(name: str) -> str:
    """The lease holder whose expiry says the persister of rank `name` is alive."""
    return HEARTBEAT + name


def alive(store: JobStore, epoch: int, name: str, now: float) -> bool:
    path = store.epoch_dir(epoch) / f"{lease.LEASE}-{heartbeat(name)}"
    try:
        return float(json.loads(path.read_text())["expires_at"]) > now
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class Settled:
    waited_s: float
    committed: tuple[int, ...] = ()
    abandoned: tuple[tuple[int, str], ...] = ()

    def describe(self) -> str:
        """One line for the job's output ("" when nothing was pending)."""
        out = [f"the final capture's images (epoch {e}) reached the image store after the job ended; waited "
               f"{self.waited_s:.0f} s for them" for e in self.committed]
        out += [f"the final capture (epoch {e}) is lost: its images did not reach the image store ({why})"
                for e, why in self.abandoned]
        return "; ".join(out)


def settle(store: JobStore, max_wait_s: float, clock: Callable[[], float] = lease.clock,
           sleep: Callable[[float], None] = time.sleep) -> Settled:
    """Before a restore is planned: every pending final epoch committed or abandoned. Waits while each rank
    still missing has a live persister, at most `max_wait_s`."""
    start = clock()
    seen: set[int] = set()
    abandoned: list[tuple[int, str]] = []
    while True:
        manifest = store.read_manifest()
        entries = pending(manifest)
        if not entries:
            done = {e["epoch"] for e in manifest["epochs"]}     # by its persisters, or here
            return Settled(clock() - start if seen else 0.0, tuple(sorted(seen & done)), tuple(abandoned))
        for entry in entries:
            epoch = entry["epoch"]
            seen.add(epoch)
            missing = [n for n in _image_ranks(entry) if not _sealed(store, epoch, n)]
            stopped = [n for n in missing if not alive(store, epoch, n, clock())]
            why = ""
            if not missing:
                try:
                    complete(store, epoch)
                    continue
                except StorageError as e:     # a rank's images do not match its rank.json: never committed
                    why = f"its commit failed: {e}"
            elif stopped:
                why = (f"the persist of rank {stopped[0]} stopped before its images were complete (its process or "
                       "node died)")
            elif clock() - start > max_wait_s:
                why = f"rank {missing[0]}'s images were not in the store within {max_wait_s:.0f} s"
            if why and abandon(store, epoch, why, rank=(stopped or missing or [""])[0]):
                abandoned.append((epoch, why))
        sleep(POLL_S)


# ---- what a requeue cost ----------------------------------------------------------------------------------
def requeue_cost(store: JobStore, restored: dict[str, Any], now: float | None = None) -> str:
    """For the line of a restore of committed epoch `restored` (its manifest entry): how old its state is at
    the requeue, and, when the final capture was lost, which one and why."""
    now = time.time() if now is None else now
    epoch = int(restored["epoch"])
    taken = restored.get("captured_at", restored.get("committed_at"))
    final = begun(store)
    if final is not None and final["epoch"] == epoch:
        return "the requeue lost nothing: it is the final capture, taken at Slurm's signal"
    if not isinstance(taken, (int, float)):
        return ""
    failed = [f for f in fresh_start.failures(store) if f.final and f.epoch > epoch]     # newest first
    if failed and (final is None or final["epoch"] <= failed[0].epoch):
        final = {"epoch": failed[0].epoch, "at": failed[0].at}        # a failure recorded without began()
    if final is None or final["epoch"] < epoch:
        return (f"taken {max(0.0, now - taken):.0f} s before this restart (no final capture was begun: the job's "
                "node or its agents were gone before Slurm's signal)")
    age = max(0.0, float(final["at"]) - taken)
    lost = next((f for f in failed if f.epoch == final["epoch"]), None)
    if lost is not None and lost.stage == "window":     # skipped before it froze: what it would have needed
        why = lost.reason.split("; the job restores")[0].removeprefix("final capture skipped: ")
        return f"taken {age:.0f} s before the requeue; the final capture (epoch {final['epoch']}) was not taken: {why}"
    why = lost.reason if lost else "it did not finish before Slurm's SIGKILL"
    return f"taken {age:.0f} s before the requeue; the final capture (epoch {final['epoch']}) was lost: {why}"
