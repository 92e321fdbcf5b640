"""Files the user controls, touched with the user's rights only, for a bounded time.

Root never opens a user's path itself: a forked child drops to the job user's credentials, opens the path,
and hands the fd back over a socketpair; the caller then compares (dev, ino) with the file it expects, so a
path swapped for a symlink or another file between two looks is refused, and a file the user could not
open is never opened for it.

Every open is non-blocking (O_NONBLOCK: a FIFO, a lease or a device put at the path answers at once
instead of waiting for the user), and every child is killed when it has not answered within its time limit
(a path through a FUSE mount the user serves can block an open or a read for as long as the user likes):
the caller gets PermissionDenied, never a wait the user controls.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time
from typing import Callable

from slurmckpt.errors import PermissionDenied
from slurmckpt.node.launch import Credentials

OPEN_TIMEOUT_S = 30.0           # an open (or a short action) on a local path answers in milliseconds
COPY_BYTES_PER_S = 100 << 20    # well below a page-cache or tmpfs copy: the budget of a copy as the user
ANSWER_MAX = 64 << 10
OK, FAILED = b"\x00", b"\x01"


def time_for(nbytes: int) -> float:
    """The time limit of an action as the user that moves `nbytes` (a copy into /dev/shm, a checksum)."""
    return OPEN_TIMEOUT_S + nbytes / COPY_BYTES_PER_S


def _become(creds: Credentials) -> None:
    os.setgroups(list(creds.groups))
    os.setgid(creds.gid)
    os.setuid(creds.uid)


def _end(pid: int, killed: bool) -> None:
    if killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.waitpid(pid, 0)


def open_as_user(creds: Credentials, path: str, flags: int, timeout_s: float = OPEN_TIMEOUT_S) -> int:
    """An fd for `path` opened as the job's user (flags plus O_NOCTTY|O_CLOEXEC|O_NONBLOCK), or
    PermissionDenied naming the path and the reason (also when no answer came within `timeout_s`)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:   # keep it to system calls: the agent may hold locks of other threads
        try:
            ours.close()
            _become(creds)
            fd = os.open(path, flags | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK)
            socket.send_fds(theirs, [b"ok"], [fd])
        except OSError as e:
            try:
                theirs.send(f"{e.strerror}".encode()[:500])
            except OSError:
                pass
        except BaseException:  # noqa: BLE001
            pass
        os._exit(0)
    theirs.close()
    killed = False
    try:
        ours.settimeout(timeout_s)
        message, fds, _, _ = socket.recv_fds(ours, 512, 1)
    except TimeoutError:
        killed = True
        message, fds = f"no answer within {timeout_s:.0f}s (the path blocked)".encode(), []
    finally:
        ours.close()
        _end(pid, killed)
    if not fds:
        raise PermissionDenied(f"cannot open {path} as the job's user: {message.decode(errors='replace') or 'no answer'}",
                               uid=creds.uid)
    return fds[0]


def same_file(fd: int, dev: int, ino: int) -> bool:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (dev, ino)


def open_expected(creds: Credentials, path: str, flags: int, dev: int, ino: int, what: str) -> int:
    """open_as_user, refused unless it is the file (dev, ino) recorded from the task's own fd."""
    fd = open_as_user(creds, path, flags)
    if not same_file(fd, dev, ino):
        os.close(fd)
        raise PermissionDenied(f"{what} {path} is not the file the task has open (replaced or a link to "
                               "another file)", uid=creds.uid)
    return fd


def call_as_user(creds: Credentials, action: Callable[[], bytes | None], what: str,
                 timeout_s: float = OPEN_TIMEOUT_S) -> bytes:
    """What `action` returns (at most 64 KiB), run in a child that has dropped to the job user's
    credentials (plain system calls: the agent may hold other threads' locks); PermissionDenied with
    `what` and the child's error if it failed, or if it did not answer within `timeout_s` (it is killed).
    Fds the caller opened before stay usable in the child (e.g. a root-owned image file to copy from).
    The child is not dumpable (its ids changed), so the user cannot trace it or forge its answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _become(creds)
            message = OK + (action() or b"")
        except OSError as e:
            message = FAILED + f"{e.strerror}{': ' + str(e.filename) if e.filename else ''}".encode()
        except BaseException as e:  # noqa: BLE001
            message = FAILED + repr(e).encode()
        try:
            view = memoryview(message[:ANSWER_MAX])
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    answer, killed = b"", False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                killed = True
                break
            block = os.read(r, ANSWER_MAX)
            if not block:
                break
            answer += block
    finally:
        os.close(r)
        _end(pid, killed)
    if killed:
        raise PermissionDenied(f"{what}: no answer within {timeout_s:.0f}s (the path blocked)", uid=creds.uid)
    if answer[:1] != OK:
        raise PermissionDenied(f"{what}: {answer[1:].decode(errors='replace') or 'no answer'}", uid=creds.uid)
    return answer[1:]


def run_as_user(creds: Credentials, action: Callable[[], None], what: str,
                timeout_s: float = OPEN_TIMEOUT_S) -> None:
    """call_as_user for an action that returns nothing."""
    def acted() -> bytes:
        action()
        return b""
    call_as_user(creds, acted, what, timeout_s)
