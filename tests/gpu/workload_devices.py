"""A CPU workload that asks, every step, whether it may open the GPU's device file: under Slurm's
ConstrainDevices a job without `--gres=gpu` must be denied (EPERM), before and after a restore.

Prints `devices step <i> <path>=<ok|ERRNO>` every --sleep seconds for --steps steps, then `DONE`."""
from __future__ import annotations

import argparse
import errno
import os
import sys
import time


def probe(path: str) -> str:
    try:
        os.close(os.open(path, os.O_RDWR))
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--path", default="/dev/nvidia0")
    a = ap.parse_args()
    for i in range(a.steps):
        print(f"devices step {i} {a.path}={probe(a.path)}", flush=True)
        time.sleep(a.sleep)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
