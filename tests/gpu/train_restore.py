"""GPU proof (a), device machine as root: a deterministic PyTorch training loop in its own PID namespace is
captured mid-run (one periodic capture that leaves it running, then final captures that end it) and
restored with criu + slurmckpt.cuda; its loss sequence must equal an uninterrupted run's bit for bit and the
magic value in device memory must survive. Prints PASS/FAIL lines; exit 0 only if everything passed.

    python3 tests/gpu/train_restore.py WORKDIR [--cycles 2] [--ns none|pid|pid+proc]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.remap import build_pairs, visible_gpus  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402

STEPS = 300
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)


def losses(text: str) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in LOSS.findall(text)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--ns", default="none", choices=sorted(harness.NAMESPACES))
    a = ap.parse_args()
    work = harness.fresh_dir(a.work)
    harness.set_subreaper()
    driver = load_driver()
    results: dict = {"ns": a.ns}
    script = str(Path(__file__).resolve().parent / "workload_train.py")

    ref = harness.Workload([sys.executable, script, "--steps", str(STEPS)], work / "ref.log", env=ENV)
    rc = ref.wait_exit(300)
    ref_losses = losses(ref.text())
    print(f"reference run: rc={rc}, {len(ref_losses)} steps, last loss {ref_losses[-1][1] if ref_losses else None}")

    w = harness.Workload([sys.executable, script, "--steps", str(STEPS), "--sleep", "0.02"], work / "cr.log",
                         ns=a.ns, env=ENV)
    try:
        w.wait_for(r"^step 40 ")
        # periodic capture: consistent cut (one rank) -> GPU checkpoint -> criu dump --leave-running -> resume
        stage = TreeGpuStage.for_tree(w.tree(), context={"rank": 0})
        t0 = time.monotonic()
        stage.lock_all(2000)         # one rank: its cut is its own lock (the coordinator's rounds: barrier/rounds.py)
        cut_s = time.monotonic() - t0
        stage.checkpoint_all()
        t1 = time.monotonic()
        dump_s = harness.dump(w.pid, work / "periodic", leave_running=True)
        t2 = time.monotonic()
        stage.restore_all(None)
        stage.unlock_all()
        t3 = time.monotonic()
        at = losses(w.text())[-1][0]
        results["periodic"] = {"at_step": at, "time_to_cut_s": round(cut_s, 4),
                               "lock_ckpt_s": round(t1 - t0, 3), "criu_dump_s": round(dump_s, 3),
                               "gpu_restore_unlock_s": round(t3 - t2, 3),
                               "image_bytes": harness.du(work / "periodic")}
        print("periodic capture:", json.dumps(results["periodic"]))
        results["cycles"] = []
        for cycle in range(a.cycles):
            target = 110 + 90 * cycle
            w.wait_for(rf"^step {target} ")
            stage = TreeGpuStage.for_tree(w.tree(), context={"rank": 0})
            stage.lock_all(2000)
            stage.checkpoint_all()
            record = stage.record()
            images = work / f"final{cycle}"
            dump_s = harness.dump(w.pid, images)
            w.reap_after_dump()
            at = losses(w.text())[-1][0]
            size = w.log.stat().st_size
            time.sleep(0.5)
            assert w.log.stat().st_size == size, "workload wrote after its final dump"
            pid, restore_s = harness.restore(images)
            w.adopt(pid)
            t4 = time.monotonic()
            restored = TreeGpuStage.adopt_restored(driver, record, harness.proctree.descendants(pid))
            pairs = build_pairs(restored.gpus, visible_gpus(driver.devices(), record["cuda_visible_devices"]))
            restored.restore_all(pairs)
            restored.unlock_all()
            t5 = time.monotonic()
            ran = w.wait_growth(size) - t5
            item = {"cycle": cycle, "dumped_after_step": at, "criu_dump_s": round(dump_s, 3),
                    "criu_restore_s": round(restore_s, 3), "gpu_restore_unlock_s": round(t5 - t4, 3),
                    "first_output_after_unlock_s": round(ran, 3), "pairs": pairs,
                    "host_pid_before": record["processes"][0]["pid"], "host_pid_after": pid,
                    "ns_pid": record["processes"][0]["ns_pid"], "image_bytes": harness.du(images)}
            results["cycles"].append(item)
            print("final capture + restore:", json.dumps(item))
        rc = w.wait_exit(300)
    except BaseException:
        w.kill()
        print(w.text()[-3000:])
        raise
    got = losses(w.text())
    text = w.text()
    checks = {
        "exit code 0": rc == 0,
        "every step once, in order": [s for s, _ in got] == list(range(STEPS)),
        "losses equal the uninterrupted run bit for bit": got == ref_losses and len(ref_losses) == STEPS,
        "magic value in device memory survived": "MAGIC OK" in text,
        "captured mid-run": all(0 < c["dumped_after_step"] < STEPS - 1 for c in results["cycles"]),
    }
    results["checks"] = checks
    results["rc"] = rc
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print("magic line:", next((l for l in text.splitlines() if l.startswith("MAGIC")), None))
    print("losses at 0/100/299:", [x for x in got if x[0] in (0, 100, 299)])
    (work / "result.json").write_text(json.dumps(results, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
