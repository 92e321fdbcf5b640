"""Device probe (root, GPU): what the unit tests' fake NVML and the capture's sizing assume, on the real GPU.

1. `slurmckpt doctor`'s GPU lines (cuda/inventory.doctor_checks) from the real pynvml.
2. A process holding --gib GiB (workload_hold.py): NVML's bytes for it (CudaRankGpu.footprint) against what
   the driver's checkpoint really copies into its host memory (RssAnon before/after cuCheckpointProcessCheckpoint),
   the measured checkpoint/restore seconds against coordinator/budget.py's estimate, the host copy freed again
   after the GPU restore (node/host_memory.py's put-back relies on it), and the data intact.
3. If jax is installed: a JAX process with its default preallocation and one with
   XLA_PYTHON_CLIENT_PREALLOCATE=false: which framework /proc/PID/maps shows, what each holds, and the note.
Prints one `key: json` line per fact; exits 1 if a check that the fakes rely on does not hold.

    python3 tests/gpu/nvml_probe.py WORKDIR [--gib 8]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.node import procfs  # noqa: E402
from slurmckpt.coordinator.budget import Estimate, RankSize  # noqa: E402
from slurmckpt.cuda import frameworks  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.inventory import doctor_checks  # noqa: E402
from slurmckpt.cuda.rank_stage import CudaRankGpu  # noqa: E402
from slurmckpt.rank.fit import measure  # noqa: E402

HERE = Path(__file__).resolve().parent
JAX_HOLD = ("import os, sys, time, jax, jax.numpy as jnp\n"
            "x = jnp.ones((256, 1024, 1024), dtype=jnp.float32).block_until_ready()\n"
            "print('READY', os.getpid(), flush=True)\ntime.sleep(120)\n")
failed: list[str] = []


def say(key: str, value: object) -> None:
    print(f"{key}: {json.dumps(value, default=str)}", flush=True)


def check(ok: bool, what: str) -> None:
    say("check", {"ok": ok, "what": what})
    if not ok:
        failed.append(what)


def start(argv: list[str], out: Path, env: dict | None = None, wait_s: float = 120) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdout=open(out, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + wait_s
    while "READY" not in out.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{argv[1]} did not get ready: {out.read_text()[-800:]}")
        time.sleep(0.2)
    return p


def rss_anon(pid: int) -> int:
    return int(procfs.status(pid)["RssAnon"][0]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--gib", type=float, default=8.0)
    a = ap.parse_args()
    work = harness.fresh_dir(Path(a.work))
    for ok, what, detail in doctor_checks():
        say("doctor", {"ok": ok, "what": what, "detail": detail})
    (work / "ctl").mkdir()
    hold = start([sys.executable, str(HERE / "workload_hold.py"), "--gib", str(a.gib), "--ctl", str(work / "ctl")],
                 work / "hold.out")
    try:
        gpu = CudaRankGpu(5000)
        fp = measure([hold.pid], gpu, work)
        nvml_bytes = fp.gpu_bytes
        say("footprint", {**fp.reply(), "refusals": fp.refusals(), "notes": list(fp.gpu.notes)})
        check(nvml_bytes >= a.gib * (1 << 30), "NVML reports at least the tensor's bytes for the process")
        driver, before = load_driver(), rss_anon(hold.pid)
        t0 = time.monotonic()
        driver.lock(hold.pid, 10_000)
        driver.checkpoint(hold.pid)
        ckpt_s = time.monotonic() - t0
        copied = rss_anon(hold.pid) - before
        t0 = time.monotonic()
        driver.restore(hold.pid, None)
        driver.unlock(hold.pid)
        restore_s = time.monotonic() - t0
        # host_memory.py puts a raised memory limit back after the GPU restore: only if the driver lets go
        # of its host copy there (else the raise is kept until the task ends)
        time.sleep(1)
        after = rss_anon(hold.pid) - before
        say("host_copy_after_restore", {"bytes": after, "share_of_copy": round(after / max(copied, 1), 3)})
        check(after <= 0.2 * copied, "the driver frees its host copy at the GPU restore (the raise's put-back)")
        e = Estimate.of([RankSize("0.0", "here", fp.host_bytes, nvml_bytes, 1, nvml_bytes)])
        say("copy", {"nvml_bytes": nvml_bytes, "host_copy_bytes": copied, "ratio": round(copied / nvml_bytes, 3),
                     "checkpoint_s": round(ckpt_s, 2), "estimate_checkpoint_s": round(e.gpu_checkpoint, 2),
                     "restore_s": round(restore_s, 2), "estimate_restore_s": round(e.gpu_restore, 2)})
        check(0.8 <= copied / nvml_bytes <= 1.05, "the host copy is about NVML's bytes (the sizing's premise)")
        check(ckpt_s <= 2 * e.gpu_checkpoint and restore_s <= 2 * e.gpu_restore,
              "checkpoint and restore stay within the timeouts' SAFETY=2 of the estimate")
        (work / "ctl" / "verify").touch()
        check(hold.wait(60) == 0, "data intact after checkpoint and restore")
    finally:
        if hold.poll() is None:
            hold.kill()
    if importlib.util.find_spec("jax") is None:
        say("jax", "not installed: framework detection not probed")
        return 1 if failed else 0
    for name, env in (("default", {}), ("on-demand", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})):
        p = start([sys.executable, "-c", JAX_HOLD], work / f"jax-{name}.out", env)
        try:
            use = CudaRankGpu(5000).footprint([p.pid])
            say(f"jax-{name}", {"framework": frameworks.framework_of(p.pid), "held": use.held, "notes": use.notes})
            check(frameworks.framework_of(p.pid) == "jax", f"JAX ({name}) recognised from its maps")
            check(bool(use.notes) == (name == "default"), f"JAX ({name}): a note exactly when it preallocates")
        finally:
            p.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
