#!/usr/bin/env python3
"""N loopback TCP connections between two process trees of one user: `serve` listens, writes its port to
--port-file and accepts N; `connect` waits for the port and connects N times. Each spreads its connections
over --procs processes (criu here cannot raise its own open file limit, so it dumps no process with more
than about a thousand fds), keeps every connection open and prints a line every second. Two steps of one
job running one each make a restore hold N connections between ranks of the node (netlock.py); `pair`
runs both as two processes here and prints their pids (a test's stand-in for two ranks)."""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time


def room_for(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 64
    if hard != resource.RLIM_INFINITY and hard < need:
        sys.exit(f"tcp_many: RLIMIT_NOFILE's hard limit {hard} is below the {need} fds {n} connections need")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def listen(n: int, port_file: str) -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(n)
    tmp = f"{port_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.rename(tmp, port_file)
    return srv


def serve(n: int, port_file: str) -> list[socket.socket]:
    srv = listen(n, port_file)
    return [srv.accept()[0] for _ in range(n)]


def connect(n: int, port_file: str) -> list[socket.socket]:
    while not os.path.exists(port_file):
        time.sleep(0.05)
    with open(port_file) as f:
        port = int(f.read())
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def spread(n: int, procs: int) -> tuple[int, bool]:
    """Fork procs - 1 helpers (each dies with this process): (this process's share of n, whether it is the
    first)."""
    import ctypes
    import signal
    for i in range(1, procs):
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
            return n // procs, False
    return n - (procs - 1) * (n // procs), True


def hold(role: str, conns: list[socket.socket], first: bool) -> None:
    if not first:
        while True:
            time.sleep(3600)
    print(f"{role}: {len(conns)} connections here", flush=True)
    tick = 0
    while True:
        time.sleep(1)
        tick += 1
        print(f"{role} tick {tick}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("serve", "connect", "pair"))
    ap.add_argument("--connections", type=int, required=True)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--procs", type=int, default=4)
    a = ap.parse_args()
    room_for(a.connections)
    if a.role == "pair":
        child = os.fork()
        if child == 0:
            conns = connect(a.connections, a.port_file)
            time.sleep(3600)
            raise SystemExit(len(conns))
        conns = serve(a.connections, a.port_file)
        print(f"pids {os.getpid()} {child}", flush=True)
        time.sleep(3600)
        raise SystemExit(len(conns))
    if a.role == "serve":
        srv = listen(a.connections, a.port_file)
        share, first = spread(a.connections, a.procs)
        hold(a.role, [srv.accept()[0] for _ in range(share)], first)
    else:
        share, first = spread(a.connections, a.procs)
        hold(a.role, connect(share, a.port_file), first)


if __name__ == "__main__":
    main()
