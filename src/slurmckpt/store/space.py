"""Space rules, checked in PREPARE before anything is locked or frozen (docs/storage.md, "Space").

A rank expects to write `raw` bytes to staging (its tree's anonymous memory plus the files the capture copies
besides criu's images, or its previous image if that was larger: it holds the GPU memory the GPU checkpoint
copied to the host) and `stored` bytes to the store (raw times the previous image's compression ratio; 1
before the first). The files copied (the output snapshot, /dev/shm files the tree holds open or mapped) are
counted by the bytes they hold, not their size (a sparse file costs its user nothing). The capture is
refused, naming what does not fit and the biggest files copied, when the staging area or the store lacks
the room, or when the job's or its user's images (committed, being written, reserved) would exceed
`quota_job` / `quota_user`. What passes is reserved (under the job's lock in the store, the node's lock in
staging) so that ranks checking at once see each other; the copies are then held to what was counted
(`CopyBudget`), whatever the files hold by the time they are copied.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from slurmckpt.store.durable import free_bytes
from slurmckpt.errors import CaptureError, StorageError
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import RANK_RESERVE, TRASH, JobStore, epoch_of, rank_name, tree_bytes
from slurmckpt.store.record import RankRecord
from slurmckpt.sizes import size_text


@dataclass(frozen=True)
class Need:
    raw: int          # bytes in staging
    stored: int       # bytes in the store
    copies: tuple[tuple[str, int], ...] = ()     # files copied besides criu's images: (name, bytes held)

    def named(self) -> str:
        """The biggest files the capture copies, for a refusal."""
        big = sorted(self.copies, key=lambda c: -c[1])[:3]
        return f"; it copies {', '.join(f'{n} ({size_text(b)})' for n, b in big)}" if big else ""


COPY_MARGIN = 64 << 20    # what the tree may add to its copied files between PREPARE and the freeze


@dataclass
class CopyBudget:
    """The bytes a capture may copy from files the user controls (output snapshots, /dev/shm files): what
    PREPARE counted and reserved, plus COPY_MARGIN and an eighth for what the tree writes before the freeze.
    A copy that would pass it is refused before it writes (the user can grow a file, or fill its holes,
    between the count and the copy)."""
    counted: int
    spent: int = 0

    @property
    def limit(self) -> int:
        return self.counted + COPY_MARGIN + self.counted // 8

    def charge(self, n: int, name: str, size: int) -> None:
        if self.spent + n > self.limit:
            raise CaptureError(f"capture refused: {name} (size {size_text(size)}) holds more data than this capture "
                               f"may copy: the files copied besides the memory images would take over "
                               f"{size_text(self.spent + n)}, {size_text(self.counted)} were counted and reserved for them "
                               f"in PREPARE (limit {size_text(self.limit)})")
        self.spent += n


@dataclass(frozen=True)
class Quotas:
    job: int = 0      # 0: off
    user: int = 0



def expected(memory: int, previous: RankRecord | None, copies: tuple[tuple[str, int], ...] = ()) -> Need:
    """From the tree's memory now, the files the capture copies (name, bytes held) and the rank's previous
    rank.json (None before its first capture)."""
    now = memory + sum(b for _, b in copies)
    if not previous:
        return Need(now, now, copies)
    raw, stored = previous.seal.raw_bytes(), previous.seal.stored_bytes()
    ratio = stored / raw if raw else 1.0
    biggest = max(now, raw)
    return Need(biggest, int(biggest * ratio), copies)


def previous_manifest(store: JobStore, step: str, rank: int) -> RankRecord | None:
    """The rank.json of the newest committed epoch that holds this rank as an image."""
    try:
        for e in store.committed():
            if e["ranks"].get(rank_name(step, rank), {}).get("kind") == "image":
                return store.read_rank_manifest(e["epoch"], step, rank)
    except StorageError:
        return None
    return None


def job_usage(store: JobStore) -> int:
    """Bytes the job's store holds, plus what its open epochs' ranks reserved and have not written yet."""
    total = 0
    if not store.job_dir.is_dir():
        return 0
    for entry in store.job_dir.iterdir():
        if entry.name.startswith(TRASH):
            continue                          # being deleted
        if epoch_of(entry.name) is None or not entry.is_dir():
            total += tree_bytes(entry)
            continue
        for item in entry.iterdir():
            if item.name.startswith(RANK_RESERVE):
                written = tree_bytes(entry / item.name[len(RANK_RESERVE):])
                total += max(0, _reserved(item) - written)
            elif not item.name.startswith("."):
                total += tree_bytes(item)
    return total


def _reserved(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["stored"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def user_usage(store: JobStore, uid: int) -> int:
    """Every job of `uid` in this cluster's part of the store (by the job-instance binding, instance.py)."""
    total = 0
    for entry in (store.root / store.cluster).iterdir():
        if not entry.name.isdigit():
            continue
        other = JobStore(store.root, store.cluster, int(entry.name))
        try:
            owner = other.read_manifest().get("instance", {}).get("uid")
        except StorageError:
            owner = None
        if owner == uid or other.job == store.job:
            total += job_usage(other)
    return total


def reserve_store(store: JobStore, epoch: int, step: str, rank: int, need: Need, quotas: Quotas,
                  uid: int) -> None:
    """Check the store's free space and the quotas; record the reservation in the epoch's directory."""
    rname = rank_name(step, rank)
    store.ensure()
    with store.lock():
        pending = job_usage(store)
        free = free_bytes(store.job_dir)
        if need.stored > free:
            raise CaptureError(f"capture refused: the image store ({store.root}) has {size_text(free)} free, this rank's "
                               f"images need about {size_text(need.stored)}{need.named()}", rank=rname)
        if quotas.job and pending + need.stored > quotas.job:
            raise CaptureError(f"capture refused: job {store.job}'s images would take {size_text(pending + need.stored)} "
                               f"(in the store now {size_text(pending)}, this rank {size_text(need.stored)}), over quota_job "
                               f"{size_text(quotas.job)}{need.named()}", rank=rname)
        if quotas.user:
            used = user_usage(store, uid)
            if used + need.stored > quotas.user:
                raise CaptureError(f"capture refused: uid {uid}'s images would take {size_text(used + need.stored)} "
                                   f"(in the store now {size_text(used)}, this rank {size_text(need.stored)}), over "
                                   f"quota_user {size_text(quotas.user)}{need.named()}", rank=rname)
        store.epoch_dir(epoch).mkdir(mode=0o700, exist_ok=True)
        (store.epoch_dir(epoch) / f"{RANK_RESERVE}{rname}").write_text(json.dumps({"stored": need.stored}))


def reserve_staging(staging: Staging, area: Path, need: Need) -> None:
    """Check staging's free space and cap; make the rank's capture area, holding the reservation."""
    staging.ensure()
    with staging.lock():
        used = staging.usage()
        free = free_bytes(staging.root)
        if need.raw > free:
            raise CaptureError(f"capture refused: the staging area ({staging.root}) has {size_text(free)} free, this "
                               f"rank's dump needs about {size_text(need.raw)}{need.named()}")
        if staging.cap and used + need.raw > staging.cap:
            raise CaptureError(f"capture refused: the staging area ({staging.root}) would hold "
                               f"{size_text(used + need.raw)}, over staging_max {size_text(staging.cap)}{need.named()}")
        staging.make(area, reserve=need.raw)


def release_store(store: JobStore, epoch: int, step: str, rank: int) -> None:
    try:
        os.unlink(store.epoch_dir(epoch) / f"{RANK_RESERVE}{rank_name(step, rank)}")
    except OSError:
        pass
