"""Device experiment: can a CUDA process live in its own PID namespace (with its own /proc mount) and go
through GPU checkpoint + criu dump + criu restore + GPU restore, twice? Prints each step's outcome. Extra criu
options (e.g. for the namespace's mounts) come from SLURMCKPT_CRIU_EXTRA (tests/gpu/harness.py).

    python3 tests/gpu/pidns_probe.py WORKDIR [NS]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402


def main() -> int:
    work = harness.fresh_dir(Path(sys.argv[1]))
    ns = sys.argv[2] if len(sys.argv) > 2 else "pid+proc"
    harness.set_subreaper()
    driver = load_driver()
    ctl = harness.fresh_dir(work / "ctl")
    w = harness.Workload([sys.executable, str(Path(__file__).parent / "workload_hold.py"), "--gib", "0.25",
                          "--ctl", str(ctl)], work / "hold.log", ns=ns)
    try:
        print("READY:", w.wait_for(r"^READY.*$", timeout=60).group(0), "host pid", w.pid, flush=True)
        for cycle in (1, 2):           # the second capture is of the restored tree (criu made its namespaces)
            stage = TreeGpuStage.for_tree(w.tree())
            stage.lock_all(2000)
            stage.checkpoint_all()
            record = stage.record()
            print(f"[{cycle}] GPU checkpointed:", record["processes"], flush=True)
            print(f"[{cycle}] criu dump: {harness.dump(w.pid, work / f'img{cycle}'):.2f} s", flush=True)
            w.reap_after_dump()
            pid, secs = harness.restore(work / f"img{cycle}")
            w.adopt(pid)
            print(f"[{cycle}] criu restore: {secs:.2f} s, new host pid {pid}", flush=True)
            restored = TreeGpuStage.adopt_restored(driver, record, harness.proctree.descendants(pid))
            restored.restore_all(None)
            restored.unlock_all()
            print(f"[{cycle}] heartbeats (GPU counter) in 2.5 s after restore:", harness.heartbeats(w), flush=True)
        print("after restore:", harness.verify_data(w, ctl), flush=True)
        print("rc", w.wait_exit(30))
        return 0
    except Exception as e:  # noqa: BLE001 - an experiment reports
        return harness.report_failure(w, e)
    finally:
        w.kill()


if __name__ == "__main__":
    sys.exit(main())
