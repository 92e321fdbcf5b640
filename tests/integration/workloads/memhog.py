#!/usr/bin/env python3
"""A workload Slurm must keep seeing: holds --mb MiB of touched memory, burns CPU, prints a counter.

Prints `memhog step N sum S` every --sleep seconds for --steps steps (S: a running checksum over the held
memory, so a restore that lost pages shows), then `memhog PASS`. From step --grow-after on it allocates
50 MiB more per step (to meet a memory limit)."""
from __future__ import annotations

import argparse
import hashlib
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--grow-after", type=int, default=-1)
    a = ap.parse_args()
    blocks = [bytearray(hashlib.sha256(str(i).encode()).digest() * (1 << 15)) for i in range(a.mb)]
    for i in range(a.steps):
        end = time.monotonic() + a.sleep
        while time.monotonic() < end:        # burn CPU: sacct's TotalCPU must see it
            pass
        block = blocks[i % len(blocks)]
        block[i % len(block)] = (block[i % len(block)] + 1) % 256
        if 0 <= a.grow_after <= i:
            blocks.extend(bytearray(1 << 20) for _ in range(50))
            for b in blocks[-50:]:
                b[::4096] = b"\1" * len(b[::4096])
        print(f"memhog step {i} sum {sum(b[i % len(b)] for b in blocks[:64])}", flush=True)
    print("memhog PASS", flush=True)


if __name__ == "__main__":
    main()
