"""Where one rank's images live during a capture and a restore: the rank's storage stages
(docs/storage.md). In order:

    space (PREPARE, before any lock or freeze)   GC this job's dead epochs; check and reserve room in the
                                                 store (free space, quotas) and in staging; the epoch's
                                                 lease extended to cover this rank's bytes (lease.py)
    record/dump/snapshot-output (CAPTURE)        into the rank's staging area (node-local)
    persist (periodic: in RESUME, after the      staging -> store: compress, checksum, fsync, rank.json;
            thaw, at bounded priority)           staging cleaned either way; the epoch's lease renewed
                                                 meanwhile
    hand_over (final: CAPTURE's last stage)      a persister outside the job's cgroups does the same after
                                                 Slurm's SIGKILL (store/final_persist.py, handover.py)
    restore                                      store -> staging (verified while unpacked) -> criu

Each function takes the rank's context and the epoch's state (context.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import slurmckpt
from slurmckpt import rates
from slurmckpt.rank import fit, output_snapshot
from slurmckpt.rank.sharing import shm_files
from slurmckpt.store import space
from slurmckpt.store import reclaim
from slurmckpt.store import handover, lease
from slurmckpt.node import detach
from slurmckpt.node import proctree
from slurmckpt.store import compression
from slurmckpt.store.compression import PLAIN, Plain, Zstd
from slurmckpt.store.durable import free_bytes
from slurmckpt.errors import CaptureError, RestoreError, SlurmckptError
from slurmckpt.store.persist import Priority, materialize, persist_kept
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore, atomic_write_json, tree_bytes
from slurmckpt.store.persist import HANDOVER

from slurmckpt.sizes import size_text

PERSISTER_START_S = 0.5      # a persister that fails within this after its start could not start at all

if TYPE_CHECKING:
    from slurmckpt.rank.context import CaptureState, RankContext, RestoreState


@dataclass(frozen=True)
class StorePolicy:
    """How a rank stages, compresses and persists its images (from the config: Config.store_policy)."""
    staging: Staging
    codec: Plain | Zstd = PLAIN
    priority: Priority | None = field(default_factory=Priority)    # None: periodic persists at full speed
    quotas: space.Quotas = field(default_factory=space.Quotas)
    lease_s: float = 30 + 600 + 1800 + lease.MARGIN_S     # an epoch's lease at the default limits (lease.py)
    spawn: detach.Spawn = detach.spawn     # starts a final capture's persister (tests: in this process)

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


def area(ctx: RankContext, epoch: int, purpose: str = "capture") -> Path:
    return ctx.policy.staging.area(ctx.store.cluster, ctx.store.job, purpose, epoch, ctx.step, ctx.rank)


def copied_files(ctx: RankContext, st: CaptureState) -> tuple[tuple[str, int], ...]:
    """What the capture copies besides the tree's memory, by the bytes each holds: the task's output files,
    the /dev/shm files the tree holds open or mapped, and the deleted files it holds, which criu copies
    into its images (ghost.py; at their size, which the ghost limit caps). A replayed batch step: its
    output only."""
    files = output_snapshot.measure(ctx.wrapper_pid) if ctx.wrapper_pid else []
    if not st.replay:
        pids = ctx.cgroup.pids()
        files += [(f.name, f.allocated) for f in shm_files.held(pids, ctx.creds.uid)]
        files += [(f"{f.path} (deleted)", f.size) for f in proctree.deleted_files(pids)]
    return tuple(files)


def reserve(ctx: RankContext, st: CaptureState) -> None:
    """PREPARE: refuse a capture that cannot fit, before anything is locked or frozen (the job runs on).
    The bytes counted for copied files become the capture's budget for them (space.CopyBudget)."""
    epoch = st.epoch
    reclaim.collect_job(ctx.store)
    copies = copied_files(ctx, st)
    if st.replay:
        need = space.Need(sum(b for _, b in copies), sum(b for _, b in copies), copies)
    else:
        need = space.expected(fit.tree_memory(ctx.cgroup.pids()),     # SIZE's estimate (fit.py)
                              space.previous_manifest(ctx.store, ctx.step, ctx.rank), copies)
    st.copy_budget = space.CopyBudget(sum(b for _, b in copies))
    st.timings["expected_mib"] = round(need.raw / 2**20, 1)
    space.reserve_store(ctx.store, epoch, ctx.step, ctx.rank, need, ctx.policy.quotas, ctx.creds.uid)
    try:
        space.reserve_staging(ctx.policy.staging, area(ctx, epoch), need)
        # the capture of a large epoch outlasts the limits its lease was allocated with: the measured rates
        images = need.raw + (st.footprint.gpu_bytes if st.footprint else 0)
        lease.extend(ctx.store, epoch, str(ctx.name), lease.clock() + ctx.policy.lease_s
                     + rates.SAFETY * (images / rates.CRIU_DUMP_BPS + images / rates.SEAL_BPS))
    except BaseException:
        space.release_store(ctx.store, epoch, ctx.step, ctx.rank)
        ctx.policy.staging.remove(area(ctx, epoch))
        raise


def release(ctx: RankContext, st: CaptureState) -> None:
    space.release_store(ctx.store, st.epoch, ctx.step, ctx.rank)
    ctx.policy.staging.remove(area(ctx, st.epoch))


def staged(ctx: RankContext, epoch: int) -> Path:
    """The rank's capture area (made by `reserve`; made here when a capture skipped it)."""
    where = area(ctx, epoch)
    if not where.is_dir():
        ctx.policy.staging.make(where)
    return where


def persist(ctx: RankContext, st: CaptureState, background: bool) -> None:
    """Staging -> store. Failure leaves the epoch uncommitted (this rank's store directory removed); the
    staging area goes either way."""
    start, epoch = time.monotonic(), st.epoch
    where = area(ctx, epoch)
    meta = st.record.whole(st.timings)
    try:
        manifest = persist_kept(ctx.store, epoch, ctx.step, ctx.rank, where, meta, ctx.policy.codec,
                                ctx.policy.priority if background else None, ctx.policy.lease_s)
    except SlurmckptError:
        st.stage_failed("persist")
        raise
    except Exception as e:
        st.stage_failed("persist")
        raise CaptureError(f"persist failed: {e}", epoch=epoch, step=ctx.step, rank=ctx.rank) from e
    finally:
        ctx.policy.staging.remove(where)
    st.record.bytes, st.record.raw_bytes = manifest.seal.stored_bytes(), manifest.seal.raw_bytes()
    st.timings["persist"] = round(time.monotonic() - start, 4)


def hand_over(ctx: RankContext, st: CaptureState) -> None:
    """A final capture's last stage inside Slurm's window: the staged images go to a persister of their own
    (store/final_persist.py: root, outside the job's cgroups, so Slurm's SIGKILL does not reach it), which
    compresses them into the store after the job has ended and commits the epoch once every rank's images
    are there (store/handover.py). What it needs is written into the staging area (root-only) first; its
    heartbeat starts before it does, and it owns the area from now on (the node's gc keeps it while it
    lives)."""
    where = area(ctx, st.epoch)
    staged = tree_bytes(where)
    st.record.bytes = st.record.raw_bytes = staged
    codec = ctx.policy.codec
    priority = ctx.policy.priority
    atomic_write_json(where / HANDOVER, {
        "meta": st.record.whole(st.timings, staged_bytes=staged).to_json(), "lease_s": ctx.policy.lease_s,
        "codec": {"name": codec.name, "level": getattr(codec, "level", 1), "threads": getattr(codec, "threads", 1)},
        "priority": None if priority is None else {"nice": priority.nice, "io_class": priority.io_class}})
    lease.extend(ctx.store, st.epoch, handover.heartbeat(str(ctx.name)), lease.clock() + handover.HEARTBEAT_S)
    argv = [sys.executable, "-m", "slurmckpt", "persist-final", "--cluster", ctx.store.cluster,
            "--job", str(ctx.store.job), "--epoch", str(st.epoch), "--step", ctx.step, "--rank", str(ctx.rank)]
    # the persister imports this very package: where it lies is handed on (an agent run from a directory
    # of root's, not a venv, has no other way to say it), with Slurm's config and nothing else
    env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF"}
    env["PYTHONPATH"] = str(Path(slurmckpt.__file__).resolve().parents[1])
    try:
        st.persister = persister = ctx.policy.spawn(argv, env)
    except OSError as e:
        raise CaptureError(f"the final capture's persister did not start: {e}", epoch=st.epoch, step=ctx.step,
                           rank=ctx.rank) from e
    ctx.policy.staging.hand_to(where, persister.pid)
    try:
        early = persister.wait(timeout=PERSISTER_START_S)      # one that cannot even start is said now
    except subprocess.TimeoutExpired:
        return
    if early:            # 0: small images, already persisted
        raise CaptureError(f"the final capture's persister failed at its start (exit {early})", epoch=st.epoch,
                           step=ctx.step, rank=ctx.rank)


def stop_persister(ctx: RankContext, st: CaptureState) -> None:
    """An epoch aborted after its hand-over (another rank failed): its persister stops, its images go."""
    if st.persister is not None and st.persister.poll() is None:
        st.persister.kill()
        st.persister.wait()
    discard(ctx, st.epoch)


def discard(ctx: RankContext, epoch: int) -> None:
    """An aborted epoch: the rank's staging area and whatever of it reached the store (never a committed
    epoch's)."""
    ctx.policy.staging.remove(area(ctx, epoch))
    ctx.store.discard_epoch_rank(epoch, ctx.step, ctx.rank)


def unpack(ctx: RankContext, st: RestoreState) -> None:
    """RESTORE: the rank's committed images verified and unpacked into a restore area (st.images, which the
    runner removes whatever happens) and its manifest (st.manifest)."""
    epoch = st.epoch
    where = st.images = area(ctx, epoch, "restore")
    ctx.policy.staging.make(where)
    manifest = ctx.store.read_rank_manifest(epoch, ctx.step, ctx.rank)
    need = manifest.seal.raw_bytes(compressed_only=True)
    free = free_bytes(where)
    if need > free:
        raise RestoreError(f"the staging area ({ctx.policy.staging.root}) has {size_text(free)} free; unpacking "
                           f"epoch {epoch} needs {size_text(need)}", step=ctx.step, rank=ctx.rank)
    start = time.monotonic()
    st.manifest = materialize(ctx.store, epoch, ctx.step, ctx.rank, where)
    st.timings["unpack"] = round(time.monotonic() - start, 4)
