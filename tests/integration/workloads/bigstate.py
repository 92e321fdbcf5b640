#!/usr/bin/env python3
"""Holds --mb MiB of seeded pseudo-random memory (incompressible: the store keeps it raw) and prints, every
--sleep seconds, the CRC of the 1 MiB block it has just changed: `bigstate step N crc C`, then `bigstate PASS`.
A restore that lost or mixed a page shows in the CRCs; `expected_lines` computes an uninterrupted run's
output (each step changes a block no earlier step changed, so the steps must stay below the blocks)."""
from __future__ import annotations

import argparse
import random
import time
import zlib

BLOCK = 1 << 20


def block(k: int) -> bytearray:
    return bytearray(random.Random(k).randbytes(BLOCK))


def step(blocks_or_block: bytearray, i: int) -> int:
    b = blocks_or_block
    b[(i * 4099) % BLOCK] = (b[(i * 4099) % BLOCK] + 1) % 256
    return zlib.crc32(b)


def expected_lines(steps: int) -> list[str]:
    return [f"bigstate step {i} crc {step(block(i), i)}" for i in range(steps)] + ["bigstate PASS"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sleep", type=float, default=0.2)
    a = ap.parse_args()
    if a.steps > a.mb:
        raise SystemExit("bigstate: --steps must not exceed --mb")
    blocks = [block(k) for k in range(a.mb)]
    print(f"bigstate holds {a.mb} MiB", flush=True)
    for i in range(a.steps):
        print(f"bigstate step {i} crc {step(blocks[i], i)}", flush=True)
        time.sleep(a.sleep)
    print("bigstate PASS", flush=True)


if __name__ == "__main__":
    main()
