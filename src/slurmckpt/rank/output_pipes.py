"""What a frozen tree wrote to its stdio pipes before the freeze, still on its way to the output file.

A step rank's stdout and stderr are pipes to slurmstepd, which relays them to srun, which appends them to
the batch output file. The batch rank snapshots that file at the capture (output_snapshot.take); a
line that still sits in a rank's pipe at that moment would be missing from the restored output, though the
restored rank has already printed it. So after the freeze each rank waits until slurmstepd has read its
pipes empty; the batch rank's snapshot, one barrier later, then only waits for slurmstepd and srun to pass
those bytes on.

The pipe is reached through the task's own fd (/proc/PID/fd/N), opened as the job's user (asuser.py) and
checked to be that pipe: root never opens what the user's fd names.
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import termios
import time

from slurmckpt.node import procfs
from slurmckpt.node import asuser
from slurmckpt.errors import SlurmckptError
from slurmckpt.node.launch import Credentials

log = logging.getLogger("slurmckpt.output_pipes")


def unread_bytes(fd: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def open_pipes(creds: Credentials, pids: list[int], fds: tuple[int, ...] = (1, 2)) -> list[int]:
    """Read ends of the distinct pipes behind the `fds` of `pids` (opened as the user, checked by inode)."""
    opened, seen = [], set()
    for pid, n in ((pid, n) for pid in pids for n in fds):
        try:
            st = procfs.fd_stat(pid, n)
        except OSError:
            continue
        if not stat.S_ISFIFO(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            opened.append(asuser.open_expected(creds, str(procfs.path(pid, "fd", n)), os.O_RDONLY,
                                               st.st_dev, st.st_ino, f"fd {n} of pid {pid}"))
        except SlurmckptError as e:
            log.info("not waiting for fd %d of pid %d to drain: %s", n, pid, e)
    return opened


def wait_drained(creds: Credentials, pids: list[int], limit_s: float = 5.0, poll_s: float = 0.02) -> bool:
    """Wait (up to limit_s) until nothing written to the stdout/stderr pipes of `pids` is left unread.
    False when time ran out: the capture goes on (the reader is stuck, not the tree), and the log says so."""
    fds = open_pipes(creds, pids)
    try:
        deadline = time.monotonic() + limit_s
        while True:
            left = sum(unread_bytes(fd) for fd in fds)
            if not left:
                return True
            if time.monotonic() >= deadline:
                log.warning("%d byte(s) of the task's output still unread by slurmstepd after %.1fs: the "
                            "output snapshot may lack them", left, limit_s)
                return False
            time.sleep(poll_s)
    finally:
        for fd in fds:
            os.close(fd)
