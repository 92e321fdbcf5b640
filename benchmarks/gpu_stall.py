"""How long a GPU capture stops the job, and how long its restore takes, at real sizes: criu copying the
GPU checkpoint's host copy (host_copy_threads 0) against slurmckpt's threads (rank/host_copy.py), paired
A/B/A/B in one run, each ratio printed beside its physical floor (device machine, root).

For each THP mode and size, one process holds N GiB on the GPU (tests/gpu/workload_hold.py) and goes
through, per pair, one periodic capture of each kind (as RESUME runs it: the tree left running):

  stall      = GPU lock + checkpoint (the driver's device-to-host copy, C) -> [threads: the host copy into
               the images] -> criu dump --leave-running [--skip-pages] -> GPU restore + unlock (R);
               beside: the threads' copy runs while criu dumps, as slurmckpt's periodic capture does
  floor      = C + R of the same capture: the driver's own copies, which no capture can avoid

and then, per kind, one final capture restored with the page cache dropped (as on another node):

  restore    = criu restore -> [threads: the host copy back in] -> GPU restore + unlock; ahead: the threads'
               host copy read ahead into the page cache while criu restores, as slurmckpt's restore does
  floor      = reading the image's bytes from the disk (the page cache dropped again) + R

Beside them: the disk's write of the image bytes (dd, fdatasync) and its read. Prints one JSON line per
measurement, then per size min/median/max of each ratio. THP modes are set for the run and put back.

    python3 benchmarks/gpu_stall.py --sizes 1,8,16 --thp madvise,always --pairs 2 --threads 8 --work /var/tmp/b
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.remap import build_pairs, visible_gpus  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402
from slurmckpt.rank import host_copy  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
BESIDE = ThreadPoolExecutor(1, thread_name_prefix="host-copy")


def thp_mode() -> str:
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def gpu_capture(tree: list[int]) -> tuple[TreeGpuStage, dict[int, list[tuple[int, int]]], float]:
    before = host_copy.anonymous_ranges(tree)
    t = time.monotonic()
    stage = TreeGpuStage.for_tree(tree, context={"rank": 0})
    stage.lock_all(2000)
    stage.checkpoint_all()
    c = time.monotonic() - t
    return stage, host_copy.grown(before, host_copy.anonymous_ranges(tree)), c


def periodic(kind: str, w: harness.Workload, images: Path, threads: int) -> dict:
    harness.fresh_dir(images)
    t0 = time.monotonic()
    stage, copies, c = gpu_capture(w.tree())
    copy_s, skip, copying = 0.0, [], None
    if kind == "threads":
        _, skip, copy_s = host_copy.copy_out(copies, images, threads)
    elif kind == "beside":     # as rank/capture.py's periodic capture: the copy runs while criu dumps
        skip, copying = host_copy.skip_list(copies), BESIDE.submit(host_copy.copy_out, copies, images, threads)
    dump_s = harness.dump(w.pid, images, leave_running=True, extra=[a for pid, s, e in skip for a in
                                                                      ("--skip-pages", f"{pid}:{s:x}-{e:x}")])
    if copying is not None:
        copy_s = copying.result()[2]
    t = time.monotonic()
    stage.restore_all(None)
    stage.unlock_all()
    r = time.monotonic() - t
    stall = time.monotonic() - t0
    image = harness.du(images)
    shutil.rmtree(images, ignore_errors=True)
    return {"cycle": "periodic", "kind": kind, "stall_s": stall, "gpu_ckpt_s": c, "gpu_restore_s": r,
            "host_copy_s": copy_s, "criu_dump_s": dump_s, "host_copy_bytes": sum(e - s for r_ in copies.values()
                                                                               for s, e in r_),
            "image_bytes": image, "ratio": stall / (c + r)}


def read_floor(images: Path) -> float:
    harness.drop_caches()
    t = time.monotonic()
    for f in sorted(images.iterdir()):
        if f.is_file():
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    return time.monotonic() - t


def write_floor(path: Path, nbytes: int) -> float:
    t = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={max(1, nbytes >> 24)}", "conv=fdatasync",
                    "status=none"], check=True)
    s = time.monotonic() - t
    path.unlink()
    return s


def final_and_restore(kind: str, w: harness.Workload, images: Path, threads: int, driver) -> dict:
    harness.fresh_dir(images)
    stage, copies, c = gpu_capture(w.tree())
    record = stage.record()
    entries, skip = [], []
    if kind in ("threads", "ahead"):
        entries, skip, _ = host_copy.copy_out(copies, images, threads)
    harness.dump(w.pid, images, extra=[a for pid, s, e in skip for a in ("--skip-pages", f"{pid}:{s:x}-{e:x}")])
    size = w.log.stat().st_size
    w.reap_after_dump()
    image = harness.du(images)
    rd = read_floor(images)
    harness.drop_caches()
    t0 = time.monotonic()
    if kind == "ahead":        # as slurmckpt's restore does: the host copy read ahead beside criu's reads
        host_copy.read_ahead(entries, images)
    pid, criu_s = harness.restore(images)     # its CUDA calls wait until the GPU restore and unlock
    w.adopt(pid)
    copy_s = host_copy.copy_in(entries, images, harness.proctree.descendants(pid), threads) if entries else 0.0
    t = time.monotonic()
    restored = TreeGpuStage.adopt_restored(driver, record, harness.proctree.descendants(pid))
    restored.restore_all(build_pairs(restored.gpus, visible_gpus(driver.devices(), record["cuda_visible_devices"])))
    restored.unlock_all()
    r = time.monotonic() - t
    restore = time.monotonic() - t0
    running = w.wait_growth(size) - t0
    shutil.rmtree(images, ignore_errors=True)
    return {"cycle": "restore", "kind": kind, "restore_s": restore, "criu_restore_s": criu_s, "host_copy_s": copy_s,
            "gpu_restore_s": r, "read_floor_s": rd, "image_bytes": image, "restore_to_running_s": running,
            "ratio": restore / (rd + r)}


def stats(xs: list[float]) -> str:
    return f"min {min(xs):6.3f}  median {statistics.median(xs):6.3f}  max {max(xs):6.3f}  (n={len(xs)})"


def bench(gib: float, thp: str, a: argparse.Namespace, driver) -> list[dict]:
    work = harness.fresh_dir(a.work / f"{thp}-{gib:g}")
    ctl = harness.fresh_dir(work / "ctl")
    w = harness.Workload([sys.executable, str(REPO / "tests" / "gpu" / "workload_hold.py"), "--gib", str(gib),
                          "--ctl", str(ctl), "--tick", "0.01"], work / "hold.log")
    rows = []

    def keep(row: dict) -> None:
        row = {"thp": thp, "gib": gib, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    try:
        w.wait_for(r"^READY", timeout=300)
        for _ in range(a.pairs):
            for kind in ("criu", "threads", "beside"):
                keep(periodic(kind, w, work / "images", a.threads))
        if not a.no_restore:
            for kind in ("criu", "threads", "ahead"):
                keep(final_and_restore(kind, w, work / "images", a.threads, driver))
        image = max(r["image_bytes"] for r in rows)
        keep({"cycle": "disk", "write_floor_s": write_floor(work / "floor.bin", image), "bytes": image})
        (ctl / "verify").touch()
        verdict = w.wait_for(r"^DATA (OK|BAD).*$", timeout=300).group(0)
        keep({"cycle": "verify", "data": verdict})
        w.wait_exit(60)
    except BaseException:
        print(w.text()[-3000:], flush=True)
        w.kill()
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    out = []
    for thp, gib in sorted({(r["thp"], r["gib"]) for r in rows}, key=lambda k: (k[0], k[1])):
        mine = [r for r in rows if (r["thp"], r["gib"]) == (thp, gib)]
        for kind in ("criu", "threads", "beside", "ahead"):
            p = [r for r in mine if r["cycle"] == "periodic" and r["kind"] == kind]
            if p:
                out.append(f"THP {thp:8} {gib:>4g} GiB {kind:7} stall/(C+R)     {stats([r['ratio'] for r in p])}  "
                           f"stall {statistics.median(r['stall_s'] for r in p):6.2f} s, C {statistics.median(r['gpu_ckpt_s'] for r in p):5.2f} s, "
                           f"R {statistics.median(r['gpu_restore_s'] for r in p):5.2f} s, copy "
                           f"{statistics.median(r['host_copy_s'] for r in p):5.2f} s, criu dump "
                           f"{statistics.median(r['criu_dump_s'] for r in p):5.2f} s")
            rs = [r for r in mine if r["cycle"] == "restore" and r["kind"] == kind]
            if rs:
                r = rs[0]
                out.append(f"THP {thp:8} {gib:>4g} GiB {kind:7} restore/(read+R) {r['ratio']:6.3f} (n=1)  restore "
                           f"{r['restore_s']:6.2f} s = criu {r['criu_restore_s']:5.2f} + copy {r['host_copy_s']:5.2f} "
                           f"+ R {r['gpu_restore_s']:5.2f}; read floor {r['read_floor_s']:5.2f} s; to running "
                           f"{r['restore_to_running_s']:6.2f} s")
        d = [r for r in mine if r["cycle"] == "disk"]
        if d:
            out.append(f"THP {thp:8} {gib:>4g} GiB disk write floor {d[0]['write_floor_s']:6.2f} s for "
                       f"{d[0]['bytes'] / 2**30:.2f} GiB")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8")
    ap.add_argument("--thp", default="madvise,always")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--no-restore", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/slurmckpt-stall"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    harness.set_subreaper()
    driver = load_driver()
    original = thp_mode()
    rows: list[dict] = []
    try:
        for thp in a.thp.split(","):
            THP.write_text(thp)
            for gib in (float(s) for s in a.sizes.split(",")):
                rows += bench(gib, thp, a, driver)
                if a.out:
                    a.out.write_text(json.dumps(rows, indent=1))
    finally:
        THP.write_text(original)
        print("\nsummary (paired in one run; C = the driver's checkpoint, R = its restore):")
        print("\n".join(summary(rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
