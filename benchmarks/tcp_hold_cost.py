#!/usr/bin/env python3
"""What a job's TCP holds (packet_filter.py) cost: the time of one hold of N rules (one batch), and a loopback
connect + accept of everyone else on the node while they are held, with iptables and with nftables. Runs in
a network namespace of its own (as root: `python3 benchmarks/tcp_hold_cost.py 2048 6000`); prints one line
per rule count. Results: benchmarks/results/tcp-holds-*.txt."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from slurmckpt.node import packet_filter  # noqa: E402
from slurmckpt.node.packet_filter import Drop  # noqa: E402


def connect_us(srv: socket.socket, n: int = 3000) -> float:
    """Microseconds per loopback connect + accept + close, best of three runs of n."""
    port = srv.getsockname()[1]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            c = socket.create_connection(("127.0.0.1", port))
            a, _ = srv.accept()
            c.close()
            a.close()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("counts", nargs="*", type=int, default=[2048], help="rule counts to hold, one line each")
    counts = ap.parse_args().counts
    if os.environ.get("TCP_HOLD_COST_NETNS") != "1":
        os.execvp("unshare", ["unshare", "--net", "env", "TCP_HOLD_COST_NETNS=1", sys.executable, *sys.argv])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4096)
    for count in counts:
        line = [f"{count} rules: none {connect_us(srv):.0f} us"]
        for method in ("iptables", "nftables"):
            packets = packet_filter.for_method(method)
            drops = [Drop("127.0.0.1", 10000 + i, "127.0.0.2", 6000) for i in range(count)]
            t = time.perf_counter()
            packet_filter.update(packets, 7, drops)
            took = time.perf_counter() - t
            line.append(f"{method} {connect_us(srv):.0f} us (hold {took:.3f} s)")
            packet_filter.lift_job(packets, 7)
        print("; ".join(line), "per loopback connect+accept", flush=True)


if __name__ == "__main__":
    main()
