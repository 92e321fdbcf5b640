"""Durable writes and locks on the image store and the staging area (docs/storage.md).

The store may be a local disk or a FUSE shared file system (GlusterFS): every write is checked in full
(short writes and ENOSPC raise, a temp file never replaces a good one), renamed into place only after
fsync, and followed by an fsync of its directory. Locks are POSIX record locks (`fcntl.lockf`): GlusterFS
and NFS forward them to the server, where `flock` stays local to one client.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from slurmckpt.errors import StorageError

LOCK_TIMEOUT_S = 120.0       # a store lock held longer than this is a hung file system, not a busy one


def write_all(fd: int, data: bytes | memoryview, name: str = "") -> int:
    """Write every byte or raise: os.write may write less than asked (near ENOSPC, on FUSE), and a
    write that makes no progress is reported as ENOSPC rather than looped on."""
    view = memoryview(data)
    total = len(view)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        view = view[n:]
    return total


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A temp name no other writer uses: host, pid, thread and a random part (two nodes, two processes or
    two threads writing the same file never share one)."""
    tag = f"{socket.gethostname()}.{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}"
    return path.with_name(f".{path.name}.tmp.{tag}")


def is_temp(name: str) -> bool:
    return name.startswith(".") and ".tmp." in name


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data`, or leave it as it was. Raises StorageError (naming the file) on any
    failure: a short write, ENOSPC, EIO, or a size on disk that differs from what was written."""
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            write_all(fd, data, str(tmp))
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != len(data):
            raise OSError(errno.EIO, f"wrote {len(data)} bytes, the file holds {size}", str(tmp))
        os.rename(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise StorageError(f"writing {path.name} failed: {e.strerror or e}", path=str(path)) from e


def atomic_write_json(path: Path, data: object, mode: int = 0o600) -> None:
    atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode(), mode)


def identity(st: os.stat_result) -> list[int]:
    """What tells a file apart from a copy of it, or from itself after a change (a restore on the node that
    stored it skips re-reading a file whose identity is unchanged: persist.py)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer could still use where `path` lives (root may use the reserve too, but
    the reserve is the file system's, not the store's)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ---- POSIX locks ----------------------------------------------------------------------------------------
@dataclass
class _Held:
    """One lock file of this process. fcntl locks belong to the process, not the fd: a second fd on the
    same file would get the lock at once and its close would drop it. So a process takes each file's
    lock once, threads queue on `mutex`, and nesting in one thread only counts."""
    mutex: threading.RLock = field(default_factory=threading.RLock)
    fd: int = -1
    depth: int = 0


_held: dict[str, _Held] = {}
_held_guard = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's fcntl locks (they are the parent process's)."""
    global _held_guard
    _held.clear()
    _held_guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@contextmanager
def posix_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S, what: str = "store lock") -> Iterator[None]:
    """Exclusive lock on `path` (created 0600 if missing, never through a symlink) across processes and
    nodes, polled up to `timeout_s`: a file system that hangs makes this raise, not hang."""
    key = os.path.abspath(path)
    with _held_guard:
        held = _held.setdefault(key, _Held())
    if not held.mutex.acquire(timeout=timeout_s):
        raise StorageError(f"{what} busy in this process for {timeout_s:.0f}s", path=key)
    try:
        if held.depth == 0:
            held.fd = _lock_file(Path(key), timeout_s, what)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0:
                os.close(held.fd)          # releases the lock
                held.fd = -1
    finally:
        held.mutex.release()


def _lock_file(path: Path, timeout_s: float, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StorageError(f"cannot open the {what}: {e.strerror}", path=str(path)) from e
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() > deadline:
                os.close(fd)
                why = "held by another process" if e.errno in (errno.EACCES, errno.EAGAIN) else e.strerror
                raise StorageError(f"cannot take the {what} within {timeout_s:.0f}s: {why}",
                                   path=str(path)) from e
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


# Errors a shared file system's client gives while its server is down or restarting (GlusterFS's FUSE client:
# ENOTCONN at once when the brick is gone, after network.ping-timeout when it stops answering; NFS: EIO,
# ESTALE, ETIMEDOUT). Anything else is no outage and is left to the caller.
UNREACHABLE = frozenset({errno.ENOTCONN, errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EHOSTDOWN,
                         errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ENETUNREACH})


def await_store(root: Path, wait_s: float, poll_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait while the image store's file system does not answer, up to `wait_s` seconds: a shared file
    system whose server restarts must not make a job start from the beginning. Returns the seconds waited;
    raises StorageError naming the error when the store did not come back in time."""
    start = clock()
    while True:
        try:
            os.stat(root)
            os.listdir(root)
            return clock() - start
        except OSError as e:
            if e.errno not in UNREACHABLE:
                return clock() - start           # not an outage: the caller meets (and reports) it
            waited = clock() - start
            if waited >= wait_s:
                raise StorageError(f"the image store {root} did not answer for {waited:.0f}s "
                                   f"({e.strerror}): is its file system's server down?") from e
        sleep(poll_s)
