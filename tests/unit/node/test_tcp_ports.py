"""Listening sockets and the tree's own connections on them, recorded from a tree, and only those connections'
TIME_WAIT entries destroyed before a restore binds the listeners again (tcp_ports.py), on real sockets of this
network namespace: another user's TIME_WAIT on the same port number is never touched."""
from __future__ import annotations

import os
import socket
import time

import pytest

from slurmckpt.node import tcp_ports
from slurmckpt.store.record import Capture


def _listener(addr: str = "127.0.0.1", port: int = 0) -> tuple[socket.socket, int]:
    """A listener without SO_REUSEADDR (as OpenMPI's), on an unprivileged port of loopback."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((addr, port))
    srv.listen(4)
    return srv, srv.getsockname()[1]


def _time_wait_at(srv: socket.socket, addr: str, port: int) -> tuple[str, int, str, int]:
    """A connection accepted by `srv` whose accepted end closes first: TIME_WAIT at addr:port."""
    client = socket.create_connection((addr, port))
    conn, _ = srv.accept()
    ends = (addr, port, *client.getsockname())
    conn.close()
    client.recv(1)
    client.close()
    return ends


def test_the_listeners_and_the_trees_own_connections_on_them_are_recorded() -> None:
    """Recorded: each listener (address, port), the tree's connections on it, and TIME_WAIT entries on it
    (a wire-up's); not: a TIME_WAIT on the same port number at another address (not the tree's listener)."""
    srv, port = _listener()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    waited = _time_wait_at(srv, "127.0.0.1", port)
    other, _ = _listener("127.0.0.2", port)
    theirs = _time_wait_at(other, "127.0.0.2", port)
    rec = tcp_ports.record([os.getpid()])
    assert ["127.0.0.1", port] in rec["listeners"] and ["127.0.0.2", port] in rec["listeners"]
    other.close()
    rec = tcp_ports.record([os.getpid()])
    assert rec["listeners"] == [["127.0.0.1", port]]
    own = {tuple(c) for c in rec["own"]}
    assert ("127.0.0.1", port, *client.getsockname()) in own and waited in own and theirs not in own
    assert all(c[1] == port for c in own)                # the client's own ephemeral end is not a listener
    assert tcp_ports.record([]) == {"listeners": [], "own": []}
    for s in (client, conn, srv):
        s.close()


@pytest.mark.system
def test_only_the_trees_own_time_wait_is_destroyed_and_another_users_on_the_same_port_survives() -> None:
    """The tree's connection, recorded at the capture, ends in TIME_WAIT on its listening port; another
    user's TIME_WAIT has the same port number at another address. Before the restore only the tree's is
    destroyed (matched by its four ends) and the listener's bind succeeds again; the other stays. The old
    code destroyed every TIME_WAIT whose local port had that number."""
    srv, port = _listener()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    recorded = tcp_ports.record([os.getpid()])          # the capture
    mine = ("127.0.0.1", port, *client.getsockname())
    conn.close()                 # the tree ends: its accepted end closes first, TIME_WAIT on 127.0.0.1:port
    client.recv(1)
    client.close()
    srv.close()
    other, _ = _listener("127.0.0.2", port)
    theirs = _time_wait_at(other, "127.0.0.2", port)
    other.close()
    assert {mine, theirs} <= tcp_ports.time_wait()
    again = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        again.bind(("127.0.0.1", port))
    t0 = time.monotonic()
    tcp_ports.free_for(recorded, wait_s=5)
    assert time.monotonic() - t0 < 4          # the other's entry does not keep 127.0.0.1:port: not waited for
    assert mine not in tcp_ports.time_wait() and theirs in tcp_ports.time_wait()
    again.bind(("127.0.0.1", port))
    again.close()


def test_a_time_wait_that_is_not_the_trees_is_waited_out_never_destroyed() -> None:
    """An entry on the listener's own address and port that the capture did not record (a wildcard
    listener of an older image, which names ports only): waited for, up to the limit, not destroyed."""
    srv, port = _listener()
    theirs = _time_wait_at(srv, "127.0.0.1", port)
    srv.close()
    t0 = time.monotonic()
    old = Capture.from_json({"tcp_listen": [port, 80, "22"]})     # privileged or malformed: ignored
    tcp_ports.free_for(old.sockets.tcp_ports, wait_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 4
    assert theirs in tcp_ports.time_wait()


def test_recorded_ends_are_checked() -> None:
    """What a restore reads back: address literals and unprivileged local ports only."""
    rec = {"listeners": [["127.0.0.1", 5000], ["x", 5001], ["127.0.0.1", 80], ["127.0.0.1", "5002"], "junk"],
           "own": [["127.0.0.1", 5000, "10.0.0.2", 40000], ["127.0.0.1", 5000, "a b", 1], ["::1", 6000, "::1", 70000]]}
    assert tcp_ports._checked(rec["listeners"], 2) == [("127.0.0.1", 5000)]
    assert tcp_ports._checked(rec["own"], 4) == [("127.0.0.1", 5000, "10.0.0.2", 40000)]
