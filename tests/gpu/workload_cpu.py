"""CPU stand-in for workload_train.py (rehearsal of tests/gpu/e2e_wrapper.py on a machine without a GPU): the
same output (`READY`, `step <i> loss <float.hex>`, `MAGIC OK|BAD`, `DONE`), deterministic, torch-free, with a
magic value filling --magic-mib MiB of host memory.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

MAGIC = 0x5EED_C0FF_EE15_600D


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--magic-mib", type=int, default=64)
    a = ap.parse_args()
    word = MAGIC.to_bytes(8, "little")
    magic = bytearray(word * (a.magic_mib * (1 << 20) // 8))
    state, loss = 1234, 2.0
    print(f"READY pid={os.getpid()}", flush=True)
    for step in range(a.steps):
        for _ in range(2000):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        loss = loss * 0.99 + (state >> 11) / float(1 << 53) * 1e-3
        print(f"step {step} loss {loss.hex()}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
    ok = magic == word * (len(magic) // 8)
    print(f"MAGIC {'OK' if ok else 'BAD'} {len(magic)} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
