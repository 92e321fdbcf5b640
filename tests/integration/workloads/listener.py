#!/usr/bin/env python3
"""A job that listens on a TCP port of its node (any address) and counts: anybody may connect to it, and
whoever does is held open (never read, never closed) by an accepting thread. Prints its port to a file
(`--port-file`) and one deterministic line per step, so a restored run's output equals an uninterrupted one's.
"""
from __future__ import annotations

import argparse
import socket
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--port-file", required=True)
    args = ap.parse_args()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(listener.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(listener.getsockname()[1]))
    import os
    os.rename(args.port_file + ".tmp", args.port_file)
    total = 0
    for i in range(args.steps):
        total += i * i
        print(f"tcp step {i} total {total}", flush=True)
        time.sleep(args.sleep)
    print(f"tcp PASS steps={args.steps}", flush=True)


def expected_lines(steps: int) -> list[str]:
    out, total = [], 0
    for i in range(steps):
        total += i * i
        out.append(f"tcp step {i} total {total}")
    return out + [f"tcp PASS steps={steps}"]


if __name__ == "__main__":
    main()
