#!/usr/bin/env python3
"""Several GPU processes of one node captured at once vs one after another (docs/gpu.md, "Several GPU
processes"), on the GPU machine, as root.

N processes (tests/gpu/workload_hold.py) each hold --gib of device memory on GPU 0. For each N in --procs, one
cycle = lock all -> checkpoint all (the stall's GPU part: the driver copies device memory into each process's
host memory) -> restore all -> unlock all, through slurmckpt's own TreeGpuStage with the real driver, once with its
calls one after another ("serial") and once at once ("concurrent", what a capture does), paired
A/B/A/B (--order). Floors beside each ratio: one process's checkpoint of the same size (the driver's own
copy of one process's memory), and the bytes over the link's pinned device->host rate (measured at the
start with torch, --no-link to skip). Prints one line per timing and a summary with min/median/max; --out
writes the JSON. Each process's data is verified (checksum) after the last cycle.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from slurmckpt.cuda.driver import ProcessState, load_driver  # noqa: E402
from slurmckpt.cuda.stage import GpuProcess, TreeGpuStage  # noqa: E402


def start(n: int, gib: float, work: Path) -> list[tuple[subprocess.Popen, Path]]:
    procs = []
    for i in range(n):
        ctl = work / f"ctl{i}"
        ctl.mkdir(parents=True, exist_ok=True)
        out = open(work / f"hold{i}.out", "w")
        p = subprocess.Popen([sys.executable, str(REPO / "tests/gpu/workload_hold.py"), "--gib", str(gib),
                              "--tick", "0.2", "--ctl", str(ctl)], stdout=out, stderr=subprocess.STDOUT)
        procs.append((p, ctl))
    for i, (p, _) in enumerate(procs):
        deadline = time.monotonic() + 300
        while "READY" not in (work / f"hold{i}.out").read_text():
            if time.monotonic() > deadline or p.poll() is not None:
                raise SystemExit(f"holder {i} did not get ready: {(work / f'hold{i}.out').read_text()[-500:]}")
            time.sleep(0.2)
    return procs


def cycle(driver, pids: list[int], concurrent: bool) -> dict[str, float]:
    stage = TreeGpuStage(driver, [GpuProcess(pid, pid, ProcessState.RUNNING) for pid in pids],
                         concurrent=concurrent)
    t = {}
    t0 = time.monotonic()
    stage.lock_all(10_000)
    t["lock"] = time.monotonic() - t0
    t0 = time.monotonic()
    stage.checkpoint_all()
    t["checkpoint"] = time.monotonic() - t0
    t0 = time.monotonic()
    stage.restore_all()
    t["restore"] = time.monotonic() - t0
    stage.unlock_all()
    return t


def link_rate() -> float:
    """Pinned device->host bytes/s through torch (the physical floor of a GPU checkpoint's copy)."""
    import torch
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 3 * n / (time.monotonic() - t0)


def spread(xs: list[float]) -> str:
    return f"min {min(xs):.2f} median {statistics.median(xs):.2f} max {max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--order", default="serial,concurrent,serial,concurrent")
    ap.add_argument("--work", default="/var/tmp/slurmckpt-gpu/concurrency")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-link", action="store_true")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rate = 0.0 if a.no_link else link_rate()
    if rate:
        print(f"link: pinned device->host {rate / 1e9:.1f} GB/s", flush=True)
    driver = load_driver()
    result: dict = {"gib": a.gib, "link_bytes_per_s": rate, "runs": {}}
    for n in [int(x) for x in a.procs.split(",")]:
        procs = start(n, a.gib, work / f"n{n}")
        pids = [p.pid for p, _ in procs]
        runs: dict[str, list[dict[str, float]]] = {"serial": [], "concurrent": []}
        try:
            for kind in a.order.split(","):
                t = cycle(driver, pids, kind == "concurrent")
                runs[kind].append(t)
                print(f"N={n} {kind:10s} checkpoint {t['checkpoint']:.2f} s restore {t['restore']:.2f} s "
                      f"lock {t['lock'] * 1000:.1f} ms", flush=True)
            for p, ctl in procs:
                (ctl / "verify").write_text("")
            for i, (p, _) in enumerate(procs):
                p.wait(120)
                text = (work / f"n{n}" / f"hold{i}.out").read_text()
                print(f"N={n} holder {i}: {'DATA OK' if 'DATA OK' in text else 'DATA BAD'}", flush=True)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
        result["runs"][n] = runs
    one = result["runs"].get(1, {}).get("concurrent", []) or result["runs"].get(1, {}).get("serial", [])
    floor1 = statistics.median(t["checkpoint"] for t in one) if one else 0.0
    print(f"\nsummary ({a.gib:g} GiB per process, order {a.order}):")
    for n, runs in result["runs"].items():
        ser = [t["checkpoint"] for t in runs["serial"]]
        con = [t["checkpoint"] for t in runs["concurrent"]]
        ser_r = [t["restore"] for t in runs["serial"]]
        con_r = [t["restore"] for t in runs["concurrent"]]
        if not ser or not con:
            continue
        ratios = [c / s for c, s in zip(con, ser)]
        link = n * a.gib * (1 << 30) / rate if rate else 0.0
        print(f"N={n}: checkpoint serial {spread(ser)} s, concurrent {spread(con)} s, concurrent/serial "
              f"{spread(ratios)}; floors: one process {floor1:.2f} s, {n} x {a.gib:g} GiB over the link "
              f"{link:.2f} s; restore serial {spread(ser_r)} s, concurrent {spread(con_r)} s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
