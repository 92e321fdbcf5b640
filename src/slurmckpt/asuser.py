"""Files the user controls, touched with the user's rights only.

Root never opens a user's path itself: a forked child drops to the job user's credentials, opens the path,
and hands the fd back over a socketpair; the caller then compares (dev, ino) with the file it expects, so a
path swapped for a symlink or another file between two looks is refused, and a file the user could not
open is never opened for it.
"""
from __future__ import annotations

import os
import socket
from typing import Callable

from slurmckpt.errors import PermissionDenied
from slurmckpt.launch import Credentials


def open_as_user(creds: Credentials, path: str, flags: int) -> int:
    """An fd for `path` opened as the job's user (flags plus O_NOCTTY|O_CLOEXEC|O_NONBLOCK), or
    PermissionDenied naming the path and the reason."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:   # keep it to system calls: the agent may hold locks of other threads
        try:
            ours.close()
            os.setgroups(list(creds.groups))
            os.setgid(creds.gid)
            os.setuid(creds.uid)
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
    try:
        message, fds, _, _ = socket.recv_fds(ours, 512, 1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
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


def run_as_user(creds: Credentials, action: Callable[[], None], what: str) -> None:
    """Run `action` (plain system calls: the agent may hold other threads' locks) in a child that has
    dropped to the job user's credentials; PermissionDenied with `what` and the child's error if it failed.
    Fds the caller opened before stay usable in the child (e.g. a root-owned image file to copy from)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        message = b"ok"
        try:
            os.setgroups(list(creds.groups))
            os.setgid(creds.gid)
            os.setuid(creds.uid)
            action()
        except OSError as e:
            message = f"{e.strerror}{': ' + str(e.filename) if e.filename else ''}".encode()
        except BaseException as e:  # noqa: BLE001
            message = repr(e).encode()
        try:
            os.write(w, message[:1000])
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            answer = f.read()
    finally:
        os.waitpid(pid, 0)
    if answer != b"ok":
        raise PermissionDenied(f"{what}: {answer.decode(errors='replace') or 'no answer'}", uid=creds.uid)
