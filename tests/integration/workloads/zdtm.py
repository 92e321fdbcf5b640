#!/usr/bin/env python3
"""zdtm-style workload: state that must survive checkpoint/restore exactly.

Keeps a counter, a seeded RNG stream, a file it appends to, a child process (a TCP echo server on loopback,
so an established TCP pair lives inside the tree) and prints one line per step. Every step's value goes
through the TCP pair and must come back equal; at the end the child reports how many messages it saw, which
must equal the number of steps (none lost, none duplicated). The output of a restored run must equal an
uninterrupted run's: `expected_lines()` computes it.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import socket
import sys
import time


def expected_lines(tag: str, steps: int, seed: int = 42) -> list[str]:
    rng = random.Random(seed)
    return [f"{tag} step {i} rng {rng.randint(0, 10**6)} echo ok" for i in range(steps)] + \
        [f"{tag} PASS steps={steps} echoed={steps}"]


def echo_server(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    f = conn.makefile("rwb", buffering=0)
    seen = 0
    for line in f:
        if line == b"END\n":
            f.write(f"{seen}\n".encode())
            break
        seen += 1
        f.write(line)
    os._exit(0)


def poison() -> int:
    """Open a userfaultfd: CRIU cannot dump one (an anon inode of no type it knows), and nothing checks for
    it before the dump, so every capture from here on fails in criu (fault injection for the 'failed capture
    keeps the previous checkpoint' test; an io_uring is refused earlier, in the check stage)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323, 0x80000 | 0x800 | 0x1)   # userfaultfd(O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY)
    if fd < 0:
        sys.exit(f"userfaultfd failed: errno {ctypes.get_errno()}")
    return fd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tag", default=os.environ.get("SLURM_PROCID", "r0"))
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--poison-at", type=int, default=-1)
    ap.add_argument("--exit-if", default=None, help="exit 3 at the first step at which this file exists")
    a = ap.parse_args()
    tag = a.tag if not a.tag.isdigit() else f"r{a.tag}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        echo_server(listener)
    listener.close()
    conn = socket.create_connection(("127.0.0.1", port))
    peer = conn.makefile("rwb", buffering=0)
    rng = random.Random(a.seed)
    data = open(a.data, "a")
    for i in range(a.steps):
        if i == a.poison_at:
            poison()
        if a.exit_if and os.path.exists(a.exit_if):
            print(f"{tag} failing at step {i}: {a.exit_if} exists", flush=True)
            sys.exit(3)
        v = rng.randint(0, 10**6)
        peer.write(f"{i} {v}\n".encode())
        back = peer.readline().decode().strip()
        status = "ok" if back == f"{i} {v}" else f"BAD({back!r})"
        data.write(f"{i} {v}\n")
        data.flush()
        print(f"{tag} step {i} rng {v} echo {status}", flush=True)
        time.sleep(a.sleep)
    peer.write(b"END\n")
    echoed = int(peer.readline())
    os.waitpid(child, 0)
    print(f"{tag} PASS steps={a.steps} echoed={echoed}", flush=True)
    sys.exit(a.exit)


if __name__ == "__main__":
    main()
