"""GPU workload for the device proofs and the benchmark: holds N GiB of device memory and ticks.

Prints `READY pid=<ns pid> sum=<checksum>` once its memory is filled, then `hb <i>` every --tick seconds.
Control files in --ctl (checked each tick, removed once acted on): `verify` (recompute the checksum, print
`DATA OK|BAD`, exit 0|3), `save` (torch.save the tensor to --state, print `SAVED <s>`), `busy` (queue a
~1 s kernel, print `BUSY`), `exit` (exit 0). stdout is a file: no fd is opened per tick, so CRIU sees the same
files at dump and restore.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def checksum(x: torch.Tensor) -> int:
    return int(x.view(torch.int64).sum().item())       # integer wrap-around: order-independent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tick", type=float, default=0.05)
    ap.add_argument("--ctl", required=True)
    ap.add_argument("--state", default="")
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // 8 * 8
    torch.manual_seed(7)
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.random_(0, 256)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    ref = checksum(x)
    print(f"READY pid={os.getpid()} bytes={n} sum={ref}", flush=True)
    i = 0
    while True:
        counter += 1
        i = int(counter.item())
        print(f"hb {i}", flush=True)
        for name in sorted(os.listdir(a.ctl)):
            path = os.path.join(a.ctl, name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            if name == "verify":
                now = checksum(x)
                print(f"DATA {'OK' if now == ref else 'BAD'} sum={now} ref={ref} hb={i}", flush=True)
                return 0 if now == ref else 3
            if name == "save":
                t = time.monotonic()
                torch.save({"x": x, "counter": counter}, a.state)
                print(f"SAVED {time.monotonic() - t:.3f}", flush=True)
            if name == "busy":
                torch.cuda._sleep(int(2e9))             # ~1 s of GPU clock cycles, asynchronous
                print("BUSY", flush=True)
                continue
            if name == "exit":
                return 0
        time.sleep(a.tick)


if __name__ == "__main__":
    sys.exit(main())
