"""Persist: a rank's staged images -> the shared store, and back for a restore (docs/storage.md).

`persist_rank` compresses each staged file straight into the rank's store directory (one pass, no second
copy), hashing the stored bytes as they are written, fsyncs every file and the directories, and writes
rank.json last. A periodic capture runs it after the thaw in a thread of bounded priority (nice, I/O
class; zstd's worker threads inherit both) so the running job keeps the CPU and the disk.
`materialize` verifies a stored rank while it unpacks it into staging; raw files are verified in place and
linked, not copied.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from slurmckpt.store.compression import PLAIN, Plain, Sink, Source, Zstd, for_stored, read_sample
from slurmckpt.config import IOPRIO_CLASSES
from slurmckpt.errors import RestoreError, StorageError
from slurmckpt.store import lease
from slurmckpt.store.durable import identity
from slurmckpt.store.jobstore import RANK_MANIFEST, JobStore, file_checksum, rank_name
from slurmckpt.store.record import Capture, RankRecord

log = logging.getLogger("slurmckpt.persist")

HANDOVER = ".handover"        # in a final capture's staging area: what its persister needs (rank/images.py)
SKIPPED = (".owner", ".reserve", HANDOVER, RANK_MANIFEST)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
T = TypeVar("T")


@dataclass(frozen=True)
class Priority:
    """What a background persist may take: nice value and I/O class of its thread(s)."""
    nice: int = 10
    io_class: str = "best-effort"        # best-effort at its lowest level, or idle

    def apply(self) -> None:
        """To the calling thread (Linux: nice and ioprio are per thread, and threads it starts inherit them)."""
        tid = threading.get_native_id()
        nr = _IOPRIO_SET.get(platform.machine())
        if nr is not None:
            value = (IOPRIO_CLASSES[self.io_class] << 13) | (7 if self.io_class == "best-effort" else 0)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(nr, 1, tid, value) != 0:          # IOPRIO_WHO_PROCESS
                log.warning("ioprio_set: %s", os.strerror(ctypes.get_errno()))
        os.setpriority(os.PRIO_PROCESS, tid, self.nice)


def bounded(priority: Priority | None, fn: Callable[[], T]) -> T:
    """Run `fn` in a thread of lowered priority (None: here, at full priority) and return what it returns."""
    if priority is None:
        return fn()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            priority.apply()
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
    t = threading.Thread(target=work, name="persist", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    result: T = box["value"]
    return result


def persist_kept(store: JobStore, epoch: int, step: str, rank: int, staged: Path, meta: Capture,
                 codec: Plain | Zstd, priority: Priority | None, lease_s: float) -> RankRecord:
    """`persist_rank` at `priority` (None: full speed), the epoch's lease renewed meanwhile (lease.py):
    however long it takes, the epoch stays leased exactly while this rank writes it."""
    with lease.kept(store, epoch, rank_name(step, rank), lease_s):
        return bounded(priority, lambda: persist_rank(store, epoch, step, rank, staged, meta, codec))


def persist_rank(store: JobStore, epoch: int, step: str, rank: int, staged: Path, meta: Capture,
                 codec: Plain | Zstd) -> RankRecord:
    """Every staged file into the store (compressed where that saves space), then rank.json. On failure the
    rank's store directory goes (the epoch stays uncommitted) and StorageError names the file."""
    rdir = store.rank_dir(epoch, step, rank)
    try:
        rdir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        rdir.mkdir(mode=0o700)
        files = {}
        for src in sorted(staged.iterdir()):
            if src.name in SKIPPED or not src.is_file() or src.is_symlink():
                continue
            try:
                if src.name.endswith(".log"):       # criu's log: kept beside the images, not part of them
                    _store_file(src, rdir, src.name, PLAIN)
                else:
                    files[src.name] = _store_file(src, rdir, src.name, codec)
            except OSError as e:
                raise StorageError(f"persisting {src.name} to the store failed: {e.strerror or e}",
                                   epoch=epoch, rank=rank_name(step, rank)) from e
        return store.seal_rank(epoch, step, rank, files, meta)
    except (OSError, StorageError) as e:
        if rdir.exists():
            store.to_trash(rdir)
            store.empty_trash_later()
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"persisting to the store failed: {e.strerror or e}",
                           epoch=epoch, rank=rank_name(step, rank)) from e


def _store_file(src: Path, rdir: Path, name: str, codec: Plain | Zstd) -> dict[str, Any]:
    size = src.stat().st_size
    if isinstance(codec, Zstd) and not codec.compressible(read_sample(str(src))):
        codec = PLAIN                       # random pages: compressing costs CPU and saves nothing
    dst = rdir / (name + codec.suffix)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        sink = Sink(fd, str(dst))
        with open(src, "rb") as f:
            codec.encode(f, sink, size)
            _drop_cache(f.fileno())
        os.fsync(fd)
        if os.fstat(fd).st_size != sink.size:
            raise OSError(errno.EIO, f"wrote {sink.size} bytes, the file holds {os.fstat(fd).st_size}", str(dst))
        _drop_cache(fd)
    finally:
        os.close(fd)
    return {"stored": dst.name, "codec": codec.name, "size": sink.size, "raw_size": size,
            "xxh3": sink.digest(), "identity": identity(os.stat(dst))}


def _drop_cache(fd: int) -> None:
    """Images read or written once need not stay in the page cache, where the job's own data lives."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def materialize(store: JobStore, epoch: int, step: str, rank: int, dest: Path) -> RankRecord:
    """The rank's images, verified, as plain files in `dest` (staging) for CRIU. Compressed files are
    unpacked while their stored bytes are hashed; raw files are hashed in place (not at all when unchanged
    since this node sealed them) and linked. Raises StorageError naming the first bad
    file, RestoreError when staging has no room."""
    manifest = store.read_rank_manifest(epoch, step, rank)
    same_node = manifest.seal.sealed_on == socket.gethostname()
    who = {"epoch": epoch, "rank": rank_name(step, rank)}
    for name, want in manifest.seal.files.items():
        if "/" in name or name.startswith("."):
            raise StorageError(f"rank.json names a bad file {name!r}", **who)
        path = store.stored_path(epoch, step, rank, name, want)
        try:
            codec = for_stored(want.get("codec", "none"))
            st = path.stat()
        except ValueError as e:
            raise StorageError(f"image file {name}: {e}", **who) from e
        except FileNotFoundError:
            raise StorageError(f"image file {name} missing", **who) from None
        if codec is PLAIN:
            # Raw files are checked where they are and linked (root-only store and staging: nothing a user
            # can swap); on the node that sealed it an unchanged inode is not even re-read.
            if not (same_node and want.get("identity") == identity(st)) and \
                    (st.st_size != want["size"] or file_checksum(path) != want["xxh3"]):
                raise StorageError(f"image file {name} corrupt (size/checksum mismatch)", **who)
            os.symlink(path, dest / name)
            continue
        try:
            _unpack(path, dest / name, codec, want, name, who)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RestoreError(f"staging ({dest.parent.parent}) has no room to unpack {name} "
                                   f"({want.get('raw_size', want['size'])} bytes)", **who) from e
            raise StorageError(f"reading image file {name} failed: {e.strerror or e}", **who) from e
    return manifest


def _unpack(path: Path, dst: Path, codec: Plain | Zstd, want: dict[str, Any], name: str, who: dict[str, Any]) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        sink = Sink(fd, str(dst), hashed=False)
        with open(path, "rb") as f:
            source = Source(f)
            try:
                codec.decode(source, sink)
            except ValueError as e:
                raise StorageError(f"image file {name} corrupt ({e})", **who) from e
            _drop_cache(f.fileno())
        os.ftruncate(fd, sink.size)          # a hole at the end (zero pages) still counts
    finally:
        os.close(fd)
    if source.size != want["size"] or source.digest() != want["xxh3"]:
        raise StorageError(f"image file {name} corrupt (size/checksum mismatch)", **who)
    if sink.size != want.get("raw_size", want["size"]):
        raise StorageError(f"image file {name} unpacks to {sink.size} bytes, not {want.get('raw_size')}", **who)
