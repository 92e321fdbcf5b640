#!/usr/bin/env python3
"""Ranks of one job exchange sequence-numbered messages in a ring, through files on the shared file system
(the transport that survives restore on other nodes): rank r appends message k to ring.r and waits for
message k in ring.(r-1). Every received message is checked (sequence number and deterministic value), so a
restored job that is not at one consistent cut either hangs, repeats or reports BAD. Output per rank:
"rR step K got V" lines, then "rR PASS".
"""
from __future__ import annotations

import argparse
import os
import random
import time


def value(rank: int, k: int) -> int:
    return random.Random(rank * 100003 + k).randint(0, 10**6)


def expected_lines(rank: int, ranks: int, steps: int) -> list[str]:
    peer = (rank - 1) % ranks
    return [f"r{rank} step {k} got {value(peer, k)}" for k in range(steps)] + [f"r{rank} PASS steps={steps}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    rank, ranks = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    peer = (rank - 1) % ranks
    out = open(os.path.join(a.dir, f"ring.{rank}"), "a")
    inbox_path = os.path.join(a.dir, f"ring.{peer}")
    offset, pending = 0, b""
    for k in range(a.steps):
        out.write(f"{k} {value(rank, k)}\n")
        out.flush()
        while b"\n" not in pending:
            try:
                with open(inbox_path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            pending += chunk
            if b"\n" not in pending:
                time.sleep(0.02)
        line, pending = pending.split(b"\n", 1)
        seq, v = (int(x) for x in line.split())
        ok = seq == k and v == value(peer, k)
        print(f"r{rank} step {k} got {v}" + ("" if ok else f" BAD(seq {seq})"), flush=True)
        time.sleep(a.sleep)
    print(f"r{rank} PASS steps={a.steps}", flush=True)


if __name__ == "__main__":
    main()
