"""Deterministic CuPy computation: a power iteration on a random matrix drawn from CuPy's device RNG, with a
custom elementwise kernel, and a magic value kept in device memory.

Prints `step <i> value <float.hex>` per step (two runs compare bit for bit), then `MAGIC OK|BAD` and `DONE`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import cupy as cp

MAGIC = 0x5EEDC0FF
damp = cp.ElementwiseKernel("float64 x, float64 s", "float64 y", "y = tanh(x / s) + 1e-3 * x", "damp")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--magic-mib", type=int, default=256)
    a = ap.parse_args()
    rng = cp.random.RandomState(1234)
    m = rng.standard_normal((2048, 2048), dtype=cp.float64)
    v = rng.standard_normal(2048, dtype=cp.float64)
    magic = cp.full(a.magic_mib << 18, MAGIC, dtype=cp.uint32)
    print(f"READY pid={os.getpid()} device={cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    for step in range(a.steps):
        v = damp(m @ v + rng.standard_normal(2048, dtype=cp.float64), cp.linalg.norm(v))
        print(f"step {step} value {float(v.sum()).hex()}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
    ok = bool((magic == MAGIC).all())
    print(f"MAGIC {'OK' if ok else 'BAD'} {magic.size * 4} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
