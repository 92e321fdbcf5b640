#!/usr/bin/env python3
"""A GPU monitor beside the workload, as jobs run them: NVML only (no CUDA context), one reading a second
("monitor used_mib=M util=U"), until --seconds pass. A restore must leave it reading."""
from __future__ import annotations

import argparse
import time

import pynvml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    a = ap.parse_args()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        mem, util = pynvml.nvmlDeviceGetMemoryInfo(h), pynvml.nvmlDeviceGetUtilizationRates(h)
        print(f"monitor used_mib={mem.used >> 20} util={util.gpu}", flush=True)
        time.sleep(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
