"""Listening ports recorded from a tree, and freed of TIME_WAIT before a restore binds them again (tcp_ports.py),
on real sockets of this network namespace."""
from __future__ import annotations

import os
import socket

import pytest

from slurmckpt import tcp_ports


def _listener() -> tuple[socket.socket, int]:
    """A listener without SO_REUSEADDR (as OpenMPI's), on an unprivileged port of loopback."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    return srv, srv.getsockname()[1]


def test_the_ports_a_tree_listens_on_are_recorded_and_its_connections_are_not() -> None:
    srv, port = _listener()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    assert port in tcp_ports.listening([os.getpid()])
    assert client.getsockname()[1] not in tcp_ports.listening([os.getpid()])
    assert tcp_ports.listening([]) == []
    for s in (client, conn, srv):
        s.close()


def test_a_time_wait_on_a_recorded_port_is_cleared_so_that_bind_succeeds_again() -> None:
    """The side that closes first keeps TIME_WAIT on the listening port: a new bind() of that port without
    SO_REUSEADDR fails until `free` cleared it, and then succeeds."""
    srv, port = _listener()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()                 # the accepted end closes first: TIME_WAIT on 127.0.0.1:port
    client.recv(1)
    client.close()
    srv.close()
    assert port in tcp_ports.in_time_wait({port})
    again = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        again.bind(("127.0.0.1", port))
    tcp_ports.free([port, 80, "22"])          # privileged or malformed entries are never touched
    assert tcp_ports.in_time_wait({port}) == set()
    again.bind(("127.0.0.1", port))
    again.close()
