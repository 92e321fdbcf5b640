"""GPU checkpoint benchmark (device machine, root): for each size (GiB of device memory held by one PyTorch
process in its own PID namespace), on the same process in the same run:

  freeze  = GPU lock + GPU checkpoint + criu dump            restore = criu restore + GPU restore + unlock
  hand    = raw cuCheckpointProcess* calls (ctypes, written here)
  ours    = slurmckpt.cuda (TreeGpuStage.for_tree: /proc scan, refusal checks, lock_all, checkpoint_all;
            adopt_restored, remap pairs, restore_all, unlock_all)
  restore-to-running = from `criu restore` until the process writes again after unlock
  cold    = new python: import torch, torch.load(map_location="cuda") of the same state, one tick

Cycles run in the order given by --order (default hand,ours,ours,hand). Images and state live on local disk
(page cache warm for both restore kinds; --drop-caches empties the page cache before every restore and before
the cold start, so both read from the disk). Prints one JSON line per measurement and a summary table.

    python3 benchmarks/gpu_checkpoint.py --sizes 1,8 --work /var/tmp/bench --out results.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.remap import build_pairs, visible_gpus  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402
from slurmckpt.errors import GpuError  # noqa: E402


class HandWired:
    """The sequence as one would write it by hand: libcuda, five calls, no checks."""

    class LockArgs(ctypes.Structure):
        _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]

    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        assert self.cu.cuInit(0) == 0

    def _ok(self, what: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} -> CUresult {rc}")

    def freeze_gpu(self, pid: int) -> None:
        args = self.LockArgs(timeoutMs=2000)
        self._ok("lock", self.cu.cuCheckpointProcessLock(pid, ctypes.byref(args)))
        self._ok("checkpoint", self.cu.cuCheckpointProcessCheckpoint(pid, None))

    def thaw_gpu(self, pid: int) -> None:
        self._ok("restore", self.cu.cuCheckpointProcessRestore(pid, None))
        self._ok("unlock", self.cu.cuCheckpointProcessUnlock(pid, None))


def cycle(kind: str, w: harness.Workload, images: Path, hand: HandWired, driver, cold_cache: bool) -> dict:
    harness.fresh_dir(images)
    t0 = time.monotonic()
    if kind == "hand":
        hand.freeze_gpu(w.pid)
        record = None
    else:
        record = harness.gpu_checkpoint(w.tree())
    t1 = time.monotonic()
    harness.dump(w.pid, images)
    t2 = time.monotonic()
    os.sync()              # what making the images durable costs more (a synchronous hand-wired capture waits)
    sync_s = time.monotonic() - t2
    w.reap_after_dump()
    size = w.log.stat().st_size
    image_bytes = harness.du(images)
    if cold_cache:
        harness.drop_caches()
    t3 = time.monotonic()
    pid, _ = harness.restore(images)
    t4 = time.monotonic()
    w.adopt(pid)
    if kind == "hand":
        hand.thaw_gpu(pid)
    else:
        restored = TreeGpuStage.adopt_restored(driver, record, harness.proctree.descendants(pid))
        restored.restore_all(build_pairs(restored.gpus, visible_gpus(driver.devices(),
                                                                     record["cuda_visible_devices"])))
        restored.unlock_all()
    t5 = time.monotonic()
    running = w.wait_growth(size)
    shutil.rmtree(images, ignore_errors=True)
    return {"kind": kind, "gpu_freeze_s": t1 - t0, "criu_dump_s": t2 - t1, "freeze_s": t2 - t0, "sync_s": sync_s,
            "criu_restore_s": t4 - t3, "gpu_restore_s": t5 - t4, "restore_s": t5 - t3,
            "restore_to_running_s": running - t3, "image_bytes": image_bytes}


def cold_start(state: Path, log: Path) -> dict:
    """Spawn -> the `RUNNING` line on its stdout (process teardown not counted)."""
    t = time.monotonic()
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "gpu" / "cold_start.py"), str(state)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    running = time.monotonic() - t
    rest, err = p.communicate(timeout=300)
    log.write_text(line + rest + err)
    if p.returncode != 0 or not line.startswith("RUNNING"):
        raise RuntimeError(f"cold start failed rc={p.returncode}: {err[-1500:]}")
    return {"cold_to_running_s": running, "cold_line": line.strip()}


def bench_size(gib: float, order: list[str], work: Path, hand: HandWired, driver, skip_cold: bool,
               first_size: float, cold_cache: bool = False) -> dict:
    ctl = harness.fresh_dir(work / "ctl")
    state = work / "state.pt"
    w = harness.Workload([sys.executable, str(REPO / "tests" / "gpu" / "workload_hold.py"), "--gib", str(gib),
                          "--ctl", str(ctl), "--state", str(state), "--tick", "0.01"], work / f"hold-{gib:g}.log")
    out: dict = {"gib": gib, "cycles": []}
    try:
        t = time.monotonic()
        w.wait_for(r"^READY", timeout=300)
        out["fill_s"] = time.monotonic() - t
        if gib == first_size:       # a stopped process is refused at once (the driver would hang on it)
            os.kill(w.pid, signal.SIGSTOP)
            time.sleep(0.1)
            t = time.monotonic()
            try:
                TreeGpuStage.for_tree(w.tree())
                verdict = "NOT refused"
            except GpuError as e:
                verdict = f"{type(e).__name__}: {e}"
            os.kill(w.pid, signal.SIGCONT)
            print(json.dumps({"stopped_process_check": verdict, "s": round(time.monotonic() - t, 4)}), flush=True)
        for kind in order:
            c = cycle(kind, w, work / "images", hand, driver, cold_cache)
            out["cycles"].append(c)
            print(json.dumps({"gib": gib, **{k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}}),
                  flush=True)
        (ctl / "verify").touch()
        out["verify"] = w.wait_for(r"^DATA (OK|BAD).*$", timeout=300).group(0)
        print(f"{gib:g} GiB after {len(order)} capture/restore cycles: {out['verify']}", flush=True)
        w.wait_exit(60)
    except BaseException:
        print(w.text()[-3000:], flush=True)
        w.kill()
        raise
    if not skip_cold:
        # the same state, saved by a fresh holder (the first one exited after verify)
        ctl2 = harness.fresh_dir(work / "ctl2")
        s = harness.Workload([sys.executable, str(REPO / "tests" / "gpu" / "workload_hold.py"), "--gib", str(gib),
                              "--ctl", str(ctl2), "--state", str(state)], work / f"save-{gib:g}.log")
        try:
            s.wait_for(r"^READY", timeout=300)
            (ctl2 / "save").touch()
            out["torch_save_s"] = float(s.wait_for(r"^SAVED (\S+)", timeout=580).group(1))
            (ctl2 / "exit").touch()
            s.wait_exit(60)
        finally:
            s.kill()
        out["state_bytes"] = state.stat().st_size
        if cold_cache:
            harness.drop_caches()
        out.update(cold_start(state, work / f"cold-{gib:g}.log"))
        state.unlink()
        print(json.dumps({"gib": gib, "torch_save_s": out["torch_save_s"], "cold_to_running_s":
                          round(out["cold_to_running_s"], 3)}),
              flush=True)
    return out


def summarize(res: dict) -> list[str]:
    def med(kind: str, key: str) -> float:
        return statistics.median(c[key] for c in res["cycles"] if c["kind"] == kind)
    lines = []
    fh, fo = med("hand", "freeze_s"), med("ours", "freeze_s")
    rh, ro = med("hand", "restore_s"), med("ours", "restore_s")
    rr = med("ours", "restore_to_running_s")
    line = (f"{res['gib']:>5g} GiB | freeze hand {fh:7.2f} s ours {fo:7.2f} s ratio {fo / fh:5.3f} | "
            f"restore hand {rh:6.2f} s ours {ro:6.2f} s ratio {ro / rh:5.3f} | restore-to-running {rr:6.2f} s")
    if "cold_to_running_s" in res:
        line += f" vs cold start+torch.load {res['cold_to_running_s']:6.2f} s ratio {rr / res['cold_to_running_s']:5.3f}"
    lines.append(line)
    hs = statistics.median(c["freeze_s"] + c["sync_s"] for c in res["cycles"] if c["kind"] == "hand")
    lines.append(f"{'':>5}     | hand made durable (freeze + sync) {hs:.2f} s: ours (dump to staging, persisted "
                 f"after the thaw) / that {fo / hs:5.3f}")
    gf = med("ours", "gpu_freeze_s")
    cd = med("ours", "criu_dump_s")
    cr = med("ours", "criu_restore_s")
    gr = med("ours", "gpu_restore_s")
    lines.append(f"{'':>5}     | ours: GPU lock+ckpt {gf:.2f} s, criu dump {cd:.2f} s, criu restore {cr:.2f} s, "
                 f"GPU restore+unlock {gr:.2f} s, image {res['cycles'][0]['image_bytes'] / 2**30:.2f} GiB; "
                 f"{res.get('verify')}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8")
    ap.add_argument("--order", default="hand,ours,ours,hand")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/slurmckpt-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--drop-caches", action="store_true", help="read images and state from the disk, not the cache")
    a = ap.parse_args()
    harness.set_subreaper()
    driver, hand = load_driver(), HandWired()
    results = []
    print(json.dumps({"page_cache": "dropped before each restore and the cold start" if a.drop_caches else "warm"}),
          flush=True)
    for gib in (float(s) for s in a.sizes.split(",")):
        results.append(bench_size(gib, a.order.split(","), harness.fresh_dir(a.work / f"{gib:g}"), hand, driver,
                                  a.skip_cold, float(a.sizes.split(",")[0]), a.drop_caches))
        shutil.rmtree(a.work / f"{gib:g}", ignore_errors=True)
        if a.out:
            a.out.write_text(json.dumps(results, indent=1))
    print("\nsummary (medians per kind):")
    for r in results:
        print("\n".join(summarize(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
