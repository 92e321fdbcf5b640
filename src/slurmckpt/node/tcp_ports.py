"""The TCP ports a tree listened on, free again before its restore binds them.

A closed connection to a listening port leaves a TIME_WAIT entry on that port for 60 s (OpenMPI's TCP
transport closes one of two crossing connections at wire-up, on the port its rank listens on). criu restores
a listening socket with the program's own SO_REUSEADDR, usually off, and bind() then fails with
EADDRINUSE: the whole restore fails and the job falls back. So the capture records the tree's listening
sockets (address and port) and the connections that are the tree's own on them: the tree's sockets there
(which turn into TIME_WAIT when the tree ends after a final capture) and the TIME_WAIT entries its
listeners hold already (a wire-up's). Before the restore, only those TIME_WAIT entries, matched by all four
of address and port at both ends, are destroyed in this network namespace (`ss -K`, SOCK_DESTROY); others
that keep a listener's bind from succeeding (another user's on the same address and port, one the tree
made after the capture) are waited out, never destroyed. Only unprivileged ports: the tree cannot have
listened on others. (Destroying every TIME_WAIT on the port number destroyed other users' too.)
"""
from __future__ import annotations

import ipaddress
import logging
import subprocess
import time
from typing import Any

from slurmckpt.node import procfs
from slurmckpt.node import proctree

log = logging.getLogger("slurmckpt.tcp_ports")

TIME_WAIT = "06"          # /proc/net/tcp state
LISTEN = "0A"
FIRST_UNPRIVILEGED = 1024
TIME_WAIT_S = 60.0        # Linux's TCP_TIMEWAIT_LEN
MAX_OWN = 4096            # connections recorded per rank
WILDCARDS = ("0.0.0.0", "::")

End = tuple[str, int]                  # address, port
Connection = tuple[str, int, str, int]  # local address, port, remote address, port


def _listeners(pids: list[int]) -> set[End]:
    if not pids:
        return set()
    inodes = proctree.socket_inodes(pids)
    return {end for f in proctree.tcp_table(pids[0]) if f[3] == LISTEN and f[9] in inodes
            and (end := proctree._hex_addr(f[1]))[1] >= FIRST_UNPRIVILEGED}


def _on(listeners: set[End], local: End) -> bool:
    """A socket at `local` is on one of the listeners (same port, same address or a wildcard one)."""
    return any(port == local[1] and (addr == local[0] or addr in WILDCARDS) for addr, port in listeners)


def record(pids: list[int]) -> dict[str, Any]:
    """At the capture: the tree's listeners and its own connections on them (see the module's doc)."""
    listeners = _listeners(pids)
    if not listeners:
        return {"listeners": [], "own": []}
    inodes = proctree.socket_inodes(pids)
    own: set[Connection] = set()
    for f in proctree.tcp_table(pids[0]):
        if f[3] == LISTEN:
            continue
        local, remote = proctree._hex_addr(f[1]), proctree._hex_addr(f[2])
        if _on(listeners, local) and (f[9] in inodes or f[3] == TIME_WAIT):
            own.add((*local, *remote))
    return {"listeners": sorted([a, p] for a, p in listeners), "own": sorted(list(c) for c in own)[:MAX_OWN]}


def time_wait(pid: int | str = "self") -> set[Connection]:
    """The TIME_WAIT entries of the network namespace of `pid`."""
    found = set()
    for table in ("tcp", "tcp6"):
        for f in procfs.net_table(pid, table):
            if len(f) > 3 and f[3] == TIME_WAIT:
                local, remote = proctree._hex_addr(f[1]), proctree._hex_addr(f[2])
                found.add((*local, *remote))
    return found


def free_for(recorded: dict[str, Any], wait_s: float = TIME_WAIT_S + 5) -> None:
    """Before a restore: destroy the tree's own TIME_WAIT entries on its listeners (`recorded`: what `record`
    returned at the capture), wait out any other that would fail a listener's bind (at most `wait_s`).
    Images of an older release name only ports (store/record.py reads them as wildcard listeners, nothing
    of their own: waited out)."""
    listeners = {(a, p) for a, p in _checked(recorded.get("listeners"), 2)}
    free(listeners, set(_checked(recorded.get("own"), 4)), wait_s)


def free(listeners: set[End], own: set[Connection], wait_s: float = TIME_WAIT_S + 5) -> None:
    def blocking() -> set[Connection]:
        return {c for c in time_wait() if _on(listeners, (c[0], c[1]))}
    busy = blocking()
    if not busy:
        return
    mine = sorted(busy & own)
    for i in range(0, len(mine), 32):
        destroy(mine[i:i + 32])
    deadline = time.monotonic() + wait_s
    while (busy := blocking()) and time.monotonic() < deadline:
        time.sleep(0.5)
    ports = sorted({p for _, p in listeners})
    if busy:
        log.warning("port(s) %s still in TIME_WAIT (%d entries, not the tree's own: waited, not destroyed): "
                    "the restore may fail to bind them", ports, len(busy))
    else:
        log.info("listening port(s) %s free for the restore (%d TIME_WAIT entries of the tree destroyed)", ports,
                 len(mine))


def destroy(connections: list[Connection]) -> None:
    """SOCK_DESTROY the TIME_WAIT entries with exactly these ends (ss matches an IPv4 address against its
    IPv4-mapped IPv6 form too)."""
    where = " or ".join(f"( src {_ss(la)}:{lp} and dst {_ss(ra)}:{rp} )" for la, lp, ra, rp in connections)
    try:
        subprocess.run(["ss", "-K", "-tan", "state", "time-wait", f"( {where} )"], capture_output=True,
                       timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not destroy %d TIME_WAIT entries: %s", len(connections), e)


def _ss(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _port(p: object) -> bool:
    return type(p) is int and FIRST_UNPRIVILEGED <= p < 65536


def _checked(entries: object, width: int) -> list[tuple[Any, ...]]:
    """Recorded ends as written (address literals, unprivileged local ports); anything else is dropped."""
    out = []
    for e in entries if isinstance(entries, list) else []:
        if not (isinstance(e, list) and len(e) == width and _port(e[1])):
            continue
        try:
            addrs = [str(ipaddress.ip_address(a)) for a in e[0::2]]
        except (TypeError, ValueError):
            continue
        if all(type(p) is int and 0 <= p < 65536 for p in e[1::2]):
            out.append(tuple(x for pair in zip(addrs, e[1::2]) for x in pair))
    return out
