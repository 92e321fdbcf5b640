"""CuPy process holding 64 MiB of plain device memory, or (--managed) of managed (UVM) memory, touched on the
GPU. Prints READY, then sleeps until killed. For the probe: what /proc shows, what the driver does."""
from __future__ import annotations

import sys
import time

import cupy as cp

n = 64 << 20
if "--managed" in sys.argv:
    a = cp.ndarray((n // 8,), cp.int64, memptr=cp.cuda.malloc_managed(n))
else:
    a = cp.zeros((n // 8,), cp.int64)
a[:] = 7
cp.cuda.Device().synchronize()
print("READY", flush=True)
while True:
    time.sleep(0.1)
