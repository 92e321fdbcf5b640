"""Where one rank's images live during a capture and a restore: the pipeline's storage stages
(docs/storage.md). In order:

    space (PREPARE, before any lock or freeze)   GC this job's dead epochs; check and reserve room in the
                                                 store (free space, quotas) and in staging; the epoch's
                                                 lease extended to cover this rank's bytes (lease.py)
    record/dump/snapshot-output (CAPTURE)        into the rank's staging area (node-local)
    persist (final: in CAPTURE, at full speed;   staging -> store: compress, checksum, fsync, rank.json;
            periodic: in RESUME, after the thaw, staging cleaned either way; the epoch's lease renewed
            at bounded priority)                 meanwhile
    restore                                      store -> staging (verified while unpacked) -> criu

Each function takes the rank's pipeline (pipeline.RankPipeline) as `p`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from slurmckpt.rank import output_snapshot
from slurmckpt.rank.sharing import shm_files
from slurmckpt.store import space
from slurmckpt.store import reclaim
from slurmckpt.store import lease
from slurmckpt.node import proctree
from slurmckpt.store import compression
from slurmckpt.store.compression import PLAIN, Plain, Zstd
from slurmckpt.coordinator import budget
from slurmckpt.store.durable import free_bytes
from slurmckpt.errors import CaptureError, RestoreError, SlurmckptError
from slurmckpt.store.persist import Priority, bounded, materialize, persist_rank
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore, rank_name
from slurmckpt.sizes import size_text


@dataclass(frozen=True)
class StorePolicy:
    """How a rank stages, compresses and persists its images (from the config: Config.store_policy)."""
    staging: Staging
    codec: Plain | Zstd = PLAIN
    priority: Priority | None = field(default_factory=Priority)    # None: periodic persists at full speed
    quotas: space.Quotas = field(default_factory=space.Quotas)
    lease_s: float = 30 + 600 + 1800 + lease.MARGIN_S     # an epoch's lease at the default limits (lease.py)

    @classmethod
    def from_config(cls, config: Any) -> "StorePolicy":
        return cls(Staging(Path(config.staging_dir), config.staging_max), compression.from_settings(config.compression, config.compression_level,
                                                                                  config.compression_threads),
                   Priority(config.persist_nice, config.persist_io_class),
                   space.Quotas(config.quota_job, config.quota_user), lease.base_s(config))

    @classmethod
    def beside(cls, store: JobStore) -> "StorePolicy":
        """Staging next to the store's root, no compression (tools and tests that name no policy)."""
        return cls(Staging(store.root.with_name(store.root.name + "-staging")), PLAIN, None)


def area(p: Any, epoch: int, purpose: str = "capture") -> Path:
    return p.policy.staging.area(p.store.cluster, p.store.job, purpose, epoch, p.step, p.rank)


def copied_files(p: Any) -> tuple[tuple[str, int], ...]:
    """What the capture copies besides the tree's memory, by the bytes each holds: the task's output files,
    the /dev/shm files the tree holds open or mapped, and the deleted files it holds, which criu copies
    into its images (ghost.py; at their size, which the ghost limit caps). A replayed batch step: its
    output only."""
    files = output_snapshot.measure(p.wrapper_pid) if p.wrapper_pid else []
    if not p.replay:
        pids = p.cgroup.pids()
        files += [(f.name, f.allocated) for f in shm_files.held(pids, p.creds.uid)]
        files += [(f"{f.path} (deleted)", f.size) for f in proctree.deleted_files(pids)]
    return tuple(files)


def reserve(p: Any, epoch: int) -> None:
    """PREPARE: refuse a capture that cannot fit, before anything is locked or frozen (the job runs on).
    The bytes counted for copied files become the capture's budget for them (space.CopyBudget)."""
    reclaim.collect_job(p.store)
    copies = copied_files(p)
    if p.replay:
        need = space.Need(sum(b for _, b in copies), sum(b for _, b in copies), copies)
    else:
        need = space.expected(proctree.memory_bytes(p.cgroup.pids()),
                              space.previous_manifest(p.store, p.step, p.rank), copies)
    p.copy_budget = space.CopyBudget(sum(b for _, b in copies))
    p.timings["expected_mib"] = round(need.raw / 2**20, 1)
    space.reserve_store(p.store, epoch, p.step, p.rank, need, p.policy.quotas, p.creds.uid)
    try:
        space.reserve_staging(p.policy.staging, area(p, epoch), need)
        # the capture of a large epoch outlasts the limits its lease was allocated with: the budget's rates
        images = need.raw + (p.footprint.gpu_bytes if p.footprint else 0)
        lease.extend(p.store, epoch, rank_name(p.step, p.rank), lease.clock() + p.policy.lease_s
                     + budget.SAFETY * (images / budget.CRIU_DUMP_BPS + images / budget.SEAL_BPS))
    except BaseException:
        space.release_store(p.store, epoch, p.step, p.rank)
        p.policy.staging.remove(area(p, epoch))
        raise


def release(p: Any, epoch: int) -> None:
    space.release_store(p.store, epoch, p.step, p.rank)
    p.policy.staging.remove(area(p, epoch))


def staged(p: Any, epoch: int) -> Path:
    """The rank's capture area (made by `reserve`; made here when a capture skipped it)."""
    where = area(p, epoch)
    if not where.is_dir():
        p.policy.staging.make(where)
    return where


def persist(p: Any, epoch: int, background: bool) -> None:
    """Staging -> store. Failure leaves the epoch uncommitted (this rank's store directory removed); the
    staging area goes either way."""
    start = time.monotonic()
    where = area(p, epoch)
    meta = {**p.record, "timings": dict(p.timings)}
    try:
        with lease.kept(p.store, epoch, rank_name(p.step, p.rank), p.policy.lease_s):    # however long it takes
            manifest = bounded(p.policy.priority if background else None,
                               lambda: persist_rank(p.store, epoch, p.step, p.rank, where, meta, p.policy.codec))
    except SlurmckptError:
        p.failed_stage = "persist"
        raise
    except Exception as e:
        p.failed_stage = "persist"
        raise CaptureError(f"persist failed: {e}", epoch=epoch, step=p.step, rank=p.rank) from e
    finally:
        p.policy.staging.remove(where)
    p.record["bytes"] = sum(f["size"] for f in manifest["files"].values())
    p.record["raw_bytes"] = sum(f.get("raw_size", f["size"]) for f in manifest["files"].values())
    p.timings["persist"] = round(time.monotonic() - start, 4)


def discard(p: Any, epoch: int) -> None:
    """An aborted epoch: the rank's staging area and whatever of it reached the store (never a committed
    epoch's)."""
    p.policy.staging.remove(area(p, epoch))
    p.store.discard_epoch_rank(epoch, p.step, p.rank)


@contextmanager
def unpacked(p: Any, epoch: int) -> Iterator[tuple[Path, dict]]:
    """The rank's committed images verified and unpacked into a restore area; the area goes afterwards."""
    where = area(p, epoch, "restore")
    p.policy.staging.make(where)
    try:
        manifest = p.store.read_rank_manifest(epoch, p.step, p.rank)
        need = sum(int(f.get("raw_size", f["size"])) for f in manifest["files"].values()
                   if f.get("codec", "none") != "none")
        free = free_bytes(where)
        if need > free:
            raise RestoreError(f"the staging area ({p.policy.staging.root}) has {size_text(free)} free; unpacking "
                               f"epoch {epoch} needs {size_text(need)}", step=p.step, rank=p.rank)
        start = time.monotonic()
        manifest = materialize(p.store, epoch, p.step, p.rank, where)
        p.timings["unpack"] = round(time.monotonic() - start, 4)
        yield where, manifest
    finally:
        p.policy.staging.remove(where)
