"""The TCP ports a tree listened on, free again before its restore binds them.

A closed connection to a listening port leaves a TIME_WAIT entry on that port for 60 s (OpenMPI's TCP
transport closes one of two crossing connections at wire-up, on the port its rank listens on). criu restores
a listening socket with the program's own SO_REUSEADDR, usually off, and bind() then fails with
EADDRINUSE: the whole restore fails and the job falls back. So the capture records the tree's listening
ports, and before the restore the TIME_WAIT entries on those ports in this network namespace are destroyed
(`ss -K`, SOCK_DESTROY), or, where the kernel cannot, waited out. Only TIME_WAIT entries are touched (no
process owns them), and only on unprivileged ports: the tree cannot have listened on others.
"""
from __future__ import annotations

import logging
import subprocess
import time

from slurmckpt import procfs, proctree

log = logging.getLogger("slurmckpt.tcp_ports")

TIME_WAIT = "06"          # /proc/net/tcp state
LISTEN = "0A"
FIRST_UNPRIVILEGED = 1024
TIME_WAIT_S = 60.0        # Linux's TCP_TIMEWAIT_LEN


def listening(pids: list[int]) -> list[int]:
    """The unprivileged TCP ports the tree's sockets listen on."""
    if not pids:
        return []
    inodes = proctree.socket_inodes(pids)
    return sorted({port for f in proctree.tcp_table(pids[0]) if f[3] == LISTEN and f[9] in inodes
                   and (port := int(f[1].rsplit(":", 1)[1], 16)) >= FIRST_UNPRIVILEGED})


def in_time_wait(ports: set[int], pid: int | str = "self") -> set[int]:
    """Which of `ports` have a TIME_WAIT entry in the network namespace of `pid`."""
    return {port for table in ("tcp", "tcp6") for f in procfs.net_table(pid, table)
            if len(f) > 3 and f[3] == TIME_WAIT and (port := int(f[1].rsplit(":", 1)[1], 16)) in ports}


def free(ports: list[int], wait_s: float = TIME_WAIT_S + 5) -> None:
    """Before a restore: no TIME_WAIT entry left on `ports` (destroyed, else waited out, at most `wait_s`)."""
    wanted = {p for p in ports if isinstance(p, int) and FIRST_UNPRIVILEGED <= p < 65536}
    busy = in_time_wait(wanted)
    if not busy:
        return
    where = " or ".join(f"sport = :{p}" for p in sorted(busy))
    try:
        subprocess.run(["ss", "-K", "-tan", "state", "time-wait", f"( {where} )"], capture_output=True,
                       timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not destroy TIME_WAIT entries on port(s) %s: %s", sorted(busy), e)
    deadline = time.monotonic() + wait_s
    while (busy := in_time_wait(wanted)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if busy:
        log.warning("port(s) %s still in TIME_WAIT: the restore may fail to bind them", sorted(busy))
    else:
        log.info("listening port(s) %s free for the restore", sorted(wanted))
