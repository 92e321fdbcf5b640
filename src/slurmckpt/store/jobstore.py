"""Image store: <root>/<cluster>/<job>/epoch-NNNNNN/<step>.<rank>/ plus the job manifest (docs/storage.md).

A rank's directory holds its stored images (compressed or raw), output snapshots and `rank.json` (per file:
codec, stored size and xxh3 of the stored bytes, raw size). An epoch becomes visible to restore only when the
coordinator's agent rewrites the job manifest (`manifest.json`) by atomic rename after EVERY rank of the epoch
persisted. Every read-modify-write of the manifest (commit, reject, prune, epoch allocation) runs under the
job's POSIX lock; the manifest it replaces is kept as `manifest.json.prev` and read when the newest is
unreadable. Restore reads only epochs listed there, and verifies the checksums before CRIU sees a byte.

Commits are fenced by the run: the manifest's `run` is the highest restart count whose agents started
(`enter_run`); an older run's allocation or commit is refused: after a requeue its agents may live on (a node
cut off from slurmctld), and its late commit would become the newest and keep-N prune the live run's.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import socket
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from slurmckpt import validate
from slurmckpt.store import lease
from slurmckpt.store.durable import atomic_write_bytes, atomic_write_json, fsync_dir, identity, posix_lock
from slurmckpt.errors import StorageError
from slurmckpt.identity import RankName
from slurmckpt.store.record import Capture, RankRecord, Seal

__all__ = ["JobStore", "atomic_write_json", "file_checksum", "list_jobs", "rank_name"]

log = logging.getLogger("slurmckpt.storage")

FORMAT_VERSION = 1
RANK_MANIFEST = "rank.json"
JOB_MANIFEST = "manifest.json"
PREVIOUS = JOB_MANIFEST + ".prev"
COUNTER = "allocated-epoch"     # the highest epoch number ever allocated for the job
LEASE = lease.LEASE             # in an epoch directory: who allocated it, until when it may still commit
RANK_RESERVE = ".reserve-"           # + step.rank: bytes a rank expects to store (space.py)
TRASH = ".trash-"


def file_checksum(path: Path) -> str:
    """xxh3 over an mmap of the file: no copy through read() buffers (2x faster on GiB images)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                h.update(m)
    return h.hexdigest()


def rank_name(step: str, rank: int) -> str:
    """Checked (validate.py) before it names a directory: a rank name is a path component."""
    return str(RankName(validate.step(step), validate.rank_index(rank)))


def epoch_of(name: str) -> int | None:
    return int(name[6:]) if name.startswith("epoch-") and name[6:].isdigit() else None


def tree_bytes(path: Path) -> int:
    """Apparent size of every file under `path` (what was written; 0 if it is gone)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _parse_manifest(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise StorageError(f"job manifest unreadable: {e}", path=str(path)) from e
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise StorageError("job manifest unreadable: no list of epochs", path=str(path))
    if data.get("version") != FORMAT_VERSION:
        raise StorageError(f"job manifest has format version {data.get('version')}, "
                           f"this slurmckpt reads {FORMAT_VERSION}", path=str(path))
    return data


@dataclass(frozen=True)
class JobStore:
    root: Path
    cluster: str
    job: int

    @property
    def job_dir(self) -> Path:
        return self.root / self.cluster / str(self.job)

    def epoch_dir(self, epoch: int) -> Path:
        return self.job_dir / f"epoch-{validate.epoch(epoch):06d}"

    def rank_dir(self, epoch: int, step: str, rank: int) -> Path:
        return self.epoch_dir(epoch) / rank_name(step, rank)

    def ensure(self) -> None:
        for d in (self.root, self.root / self.cluster, self.job_dir):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)

    def lock(self) -> AbstractContextManager[None]:
        """The job's lock, beside (not in) the job directory: instance.claim renames that directory."""
        return posix_lock(self.root / self.cluster / f".lock-{self.job}", what=f"lock of job {self.job}'s store")

    # ---- the job manifest --------------------------------------------------------------------------------
    def read_manifest(self) -> dict[str, Any]:
        return self._load()[0]

    def _load(self) -> tuple[dict[str, Any], bytes | None]:
        """(manifest, its bytes if manifest.json itself was good). An unreadable newest manifest falls back
        to the previous one; only if both are unreadable is the store's history lost."""
        path = self.job_dir / JOB_MANIFEST
        error: StorageError | None = None
        try:
            raw = path.read_bytes()
            return _parse_manifest(raw, path), raw
        except FileNotFoundError:
            pass
        except StorageError as e:
            error = e
        try:
            previous = _parse_manifest((self.job_dir / PREVIOUS).read_bytes(), self.job_dir / PREVIOUS)
        except (FileNotFoundError, StorageError):
            if error is not None:
                raise error
            return {"version": FORMAT_VERSION, "job": self.job, "cluster": self.cluster, "epochs": []}, None
        log.warning("job %d: %s; using the previous manifest", self.job, error or "manifest.json missing")
        return previous, None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the job manifest (caller holds self.lock()). The current one, if good, becomes the
        previous one first, so a manifest damaged later still leaves the commit before it."""
        _, current = self._load()
        if current is not None:
            atomic_write_bytes(self.job_dir / PREVIOUS, current)
        atomic_write_json(self.job_dir / JOB_MANIFEST, manifest)

    def committed(self) -> list[dict[str, Any]]:
        """Committed epochs, newest first."""
        return sorted(self.read_manifest()["epochs"], key=lambda e: e["epoch"], reverse=True)

    def reject(self, epoch: int, reason: str) -> bool:
        """Take a committed epoch out of restore (one rank could not restore it, so no rank may: the job
        must restart from one cut). Its images stay on disk until pruned; the reason is kept. Returns
        whether the epoch was still committed."""
        with self.lock():
            manifest = self.read_manifest()
            kept = [e for e in manifest["epochs"] if e["epoch"] != epoch]
            if len(kept) == len(manifest["epochs"]):
                return False
            manifest["epochs"] = kept
            manifest.setdefault("rejected", []).append({"epoch": epoch, "reason": reason, "at": time.time()})
            self.write_manifest(manifest)
            return True

    # ---- runs and epoch numbers ------------------------------------------------------------------------------
    def enter_run(self, run: int) -> int:
        """An agent of run `run` (restart count) started: older runs commit nothing now. The store's run."""
        self.ensure()
        with self.lock():
            manifest = self.read_manifest()
            if (stored := _run_of(manifest)) is None or run > stored:
                manifest["run"] = run
                self.write_manifest(manifest)
            return int(manifest["run"])

    def _counter(self) -> int:
        try:
            return int((self.job_dir / COUNTER).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def next_epoch(self) -> int:
        """A hint (no lock): above every epoch committed, rejected, allocated or left on disk."""
        manifest = self.read_manifest()
        seen = [e["epoch"] for e in manifest["epochs"]] + [r["epoch"] for r in manifest.get("rejected", [])]
        if self.job_dir.exists():
            seen += [n for p in self.job_dir.iterdir() if (n := epoch_of(p.name)) is not None]
        return max([*seen, self._counter()], default=0) + 1

    def allocate_epoch(self, at_least: int, lease_s: float, owner: str, run: int | None = None) -> int:
        """A new epoch number for this job, unique across its steps, coordinators and nodes: under the job
        lock, above every number seen, its directory made (with a lease: until when it may still commit;
        lease.py, reclaim.py removes it after that if uncommitted) and the counter advanced. Refused to a
        `run` older than the store's (see above)."""
        self.ensure()
        with self.lock():
            fenced(self.read_manifest(), run, at_least, "a new epoch")
            epoch = max(self.next_epoch(), at_least)
            while True:
                try:
                    self.epoch_dir(epoch).mkdir(mode=0o700)
                    break
                except FileExistsError:
                    epoch += 1
            try:
                lease.write(self.epoch_dir(epoch), owner, lease.clock() + lease_s, run)
                self.raise_counter(epoch)
            except StorageError:
                shutil.rmtree(self.epoch_dir(epoch), ignore_errors=True)     # nothing used the number yet
                raise
            return epoch

    def raise_counter(self, epoch: int) -> None:
        """No number up to `epoch` is handed out again (caller holds self.lock())."""
        if epoch > self._counter():
            atomic_write_bytes(self.job_dir / COUNTER, str(epoch).encode())

    # ---- rank manifests ----------------------------------------------------------------------------------
    def seal_rank(self, epoch: int, step: str, rank: int, files: dict[str, dict[str, Any]],
                  capture: Capture) -> RankRecord:
        """Write rank.json (last: its presence means the rank's images are complete and durable)."""
        rdir = self.rank_dir(epoch, step, rank)
        record = RankRecord(capture, Seal(self.job, step, rank, epoch, files, time.time(), socket.gethostname()))
        fsync_dir(rdir)
        atomic_write_json(rdir / RANK_MANIFEST, record.to_json())
        fsync_dir(rdir.parent)
        return record

    def write_rank_manifest(self, epoch: int, step: str, rank: int, capture: Capture) -> RankRecord:
        """Seal files already in the rank's directory as stored raw (no staging: tools and tests)."""
        rdir = self.rank_dir(epoch, step, rank)
        files = {}
        for p in sorted(rdir.iterdir()):
            if p.is_file() and p.name != RANK_MANIFEST and not p.name.endswith(".log"):
                st = p.stat()
                files[p.name] = {"size": st.st_size, "raw_size": st.st_size, "codec": "none",
                                 "xxh3": file_checksum(p), "identity": identity(st)}
        return self.seal_rank(epoch, step, rank, files, capture)

    def read_rank_manifest(self, epoch: int, step: str, rank: int) -> RankRecord:
        """The rank's rank.json (store/record.py); StorageError when it is missing, unreadable or of a format
        this release does not read."""
        path = self.rank_dir(epoch, step, rank) / RANK_MANIFEST
        try:
            return RankRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError as e:
            raise StorageError("rank image incomplete (no rank.json)", epoch=epoch, rank=rank_name(step, rank)) from e
        except ValueError as e:
            raise StorageError(f"rank.json unreadable: {e}", epoch=epoch, rank=rank_name(step, rank)) from e
        except StorageError as e:
            raise StorageError(str(e), epoch=epoch, rank=rank_name(step, rank)) from e

    def stored_path(self, epoch: int, step: str, rank: int, name: str, entry: dict[str, Any]) -> Path:
        stored = entry.get("stored", name)
        if "/" in stored or stored.startswith("."):
            raise StorageError(f"rank.json names a bad file {stored!r}", epoch=epoch, rank=rank_name(step, rank))
        return self.rank_dir(epoch, step, rank) / str(stored)

    def verify_rank(self, epoch: int, step: str, rank: int, full: bool = False) -> RankRecord:
        """Sizes and checksums of every stored file; raises StorageError naming the first bad file. On the node
        that sealed it, a file whose inode, size, mtime and ctime are unchanged is not re-hashed (nothing wrote
        it since: only root can, and any write moves ctime); elsewhere (shared storage) every byte is hashed."""
        manifest = self.read_rank_manifest(epoch, step, rank)
        same_node = manifest.seal.sealed_on == socket.gethostname() and not full
        for name, want in manifest.seal.files.items():
            path = self.stored_path(epoch, step, rank, name, want)
            try:
                st = path.stat()
            except FileNotFoundError:
                raise StorageError(f"image file {name} missing", epoch=epoch, rank=rank_name(step, rank)) from None
            if same_node and want.get("identity") == identity(st):
                continue
            if st.st_size != want["size"] or file_checksum(path) != want["xxh3"]:
                raise StorageError(f"image file {name} corrupt (size/checksum mismatch)",
                                   epoch=epoch, rank=rank_name(step, rank))
        return manifest

    def _require_complete(self, epoch: int, name: str) -> float | None:     # -> rank.json's captured_at
        step, rank = validate.rank_name(name)
        manifest = self.read_rank_manifest(epoch, step, rank)
        for fname, want in manifest.seal.files.items():
            path = self.stored_path(epoch, step, rank, fname, want)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise StorageError(f"image file {fname} missing", epoch=epoch, rank=name) from None
            if size != want["size"]:
                raise StorageError(f"image file {fname} has {size} bytes, rank.json says {want['size']}",
                                   epoch=epoch, rank=name)
        return manifest.capture.tree.captured_at or None

    # ---- commit --------------------------------------------------------------------------------------------
    def commit(self, epoch: int, ranks: dict[str, dict[str, Any]], reason: str, keep: int, run: int | None = None,
               handed_over: bool = False) -> dict[str, Any]:
        """Make `epoch` the newest restorable checkpoint. `ranks` maps "step.rank" to its record: kind
        image|replay need a complete rank.json and every stored file at its size; kind completed records a
        finished task's exit code. Committing an epoch again adds ranks to it (never drops another's).
        `run` (the agent's restart count) older than the store's: refused, nothing becomes newest or pruned,
        unless `handed_over`: a final epoch whose hand-over the caller found under this lock (handover.py)."""
        with self.lock():
            manifest = self.read_manifest()
            if not handed_over:
                fenced(manifest, run, epoch, "commit")
            taken = [self._require_complete(epoch, n) for n, r in ranks.items() if r.get("kind") in ("image", "replay")]
            if any(r["epoch"] == epoch for r in manifest.get("rejected", [])):
                raise StorageError("epoch was withdrawn; it is never committed again", epoch=epoch)
            old = next((e for e in manifest["epochs"] if e["epoch"] == epoch), None)
            entry = {"epoch": epoch, "reason": reason, "committed_at": time.time(),
                     "ranks": {**(old["ranks"] if old else {}), **ranks}, **({"run": run} if run is not None else {}),
                     **({"captured_at": min(t for t in taken if t)} if any(taken) else {})}
            if "pending" in manifest:        # the epoch's hand-over record, if it had one (handover.py)
                manifest["pending"] = [p for p in manifest["pending"] if p.get("epoch") != epoch]
            epochs = sorted([e for e in manifest["epochs"] if e["epoch"] != epoch] + [entry],
                            key=lambda e: e["epoch"])
            manifest["epochs"], dropped = _keep_newest(epochs, keep)
            self.write_manifest(manifest)
            for name in (p.name for p in self.epoch_dir(epoch).glob(".*") if p.name.startswith((LEASE, RANK_RESERVE))):
                _unlink(self.epoch_dir(epoch) / name)
            for gone in dropped:       # only after the new manifest is durable; deleted off the critical path
                self.to_trash(self.epoch_dir(gone["epoch"]))
            return manifest

    def to_trash(self, path: Path) -> None:
        """Rename away now (atomic: no reader sees half of it), delete later (empty_trash)."""
        try:
            os.rename(path, self.job_dir / f"{TRASH}{path.name}-{time.time_ns()}")
        except OSError:
            pass

    def empty_trash(self) -> None:
        for p in self.job_dir.glob(TRASH + "*"):
            shutil.rmtree(p, ignore_errors=True)

    def discard_epoch_rank(self, epoch: int, step: str, rank: int) -> None:
        """An aborted epoch's images of one rank; never touches a committed epoch. The epoch's directory
        goes with its last rank."""
        with self.lock():
            if any(e["epoch"] == epoch for e in self.read_manifest()["epochs"]):
                return
            if self.rank_dir(epoch, step, rank).exists():
                self.to_trash(self.rank_dir(epoch, step, rank))
            _unlink(self.epoch_dir(epoch) / f"{RANK_RESERVE}{rank_name(step, rank)}")
            try:
                if not any(not p.name.startswith(".") for p in self.epoch_dir(epoch).iterdir()):
                    self.to_trash(self.epoch_dir(epoch))
            except FileNotFoundError:
                pass
        self.empty_trash_later()

    def empty_trash_later(self) -> None:     # deleting GiBs takes a while: never on a freeze's or commit's path
        threading.Thread(target=self.empty_trash, name="empty-trash", daemon=True).start()


def _keep_newest(epochs: list[dict[str, Any]], keep: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Keep, for every rank, the `keep` newest epochs that hold it (0: keep all). Steps with coordinators of
    their own commit epochs that hold only their ranks: one step's commits never prune another's."""
    if not keep:
        return epochs, []
    wanted: set[int] = set()
    for name in {n for e in epochs for n in e["ranks"]}:
        holding = [e["epoch"] for e in epochs if name in e["ranks"]]
        wanted.update(holding[-keep:])
    wanted.update(e["epoch"] for e in epochs[-keep:] if not e["ranks"])    # epochs that hold no rank
    return [e for e in epochs if e["epoch"] in wanted], [e for e in epochs if e["epoch"] not in wanted]


def fenced(manifest: dict[str, Any], run: int | None, epoch: int, what: str) -> None:
    """Refuse `what` to a run older than the manifest's; a newer run becomes the manifest's."""
    current = _run_of(manifest)
    if run is not None and current is not None and run < current:
        raise StorageError(f"{what} refused: this is run {run} of the job (restart count), and run {current} "
                           "has started since (the job was requeued); an older run's checkpoint never "
                           "becomes the newest one", epoch=epoch)
    if run is not None and (current is None or run > current):
        manifest["run"] = run


def _run_of(manifest: dict[str, Any]) -> int | None:
    return manifest["run"] if type(manifest.get("run")) is int else None


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def list_jobs(root: Path) -> list[tuple[str, int]]:
    clusters = sorted(c for c in root.iterdir() if c.is_dir() and not c.name.startswith(".")) if root.exists() else []
    return [(c.name, int(j.name)) for c in clusters for j in sorted(c.iterdir()) if j.name.isdigit()]
