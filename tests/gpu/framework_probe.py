"""Device experiment: which framework processes survive the periodic capture's GPU sequence (lock,
checkpoint, [criu dump --leave-running], restore, unlock) a few times in a row, and what the driver says at
each step. Prints one line per step with the driver's state and error, then whether the program still runs.

    python3 tests/gpu/framework_probe.py WORKDIR VARIANT...
    VARIANT: jax | jax-platform | jax-criu | graph-fork-criu | graph-spawn-criu
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402

HERE = Path(__file__).resolve().parent
JAX_ENV = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
VARIANTS = {
    "jax": (["workload_jax.py"], JAX_ENV, False),
    "jax-platform": (["workload_jax.py"], {**JAX_ENV, "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, False),
    "jax-criu": (["workload_jax.py"], JAX_ENV, True),
    "graph-fork-criu": (["workload_graph_loader.py"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, True),
    "graph-spawn-criu": (["workload_graph_loader.py", "--mp", "spawn"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, True),
}


def step(driver, what, fn, pid):
    t = time.monotonic()
    try:
        fn()
        err = "ok"
    except Exception as e:  # noqa: BLE001 - the probe reports every failure
        err = f"FAILED {e}"
    try:
        state = driver.state(pid).name
    except Exception as e:  # noqa: BLE001
        state = f"? ({e})"
    print(f"  {what:<11} {err:<60.200} state={state} {time.monotonic() - t:.2f}s", flush=True)
    return err == "ok"


def main() -> int:
    work = harness.fresh_dir(Path(sys.argv[1]))
    harness.set_subreaper()
    driver = load_driver()
    for name in sys.argv[2:]:
        argv, env, with_criu = VARIANTS[name]
        print(f"=== {name}", flush=True)
        w = harness.Workload([sys.executable, str(HERE / argv[0]), *argv[1:], "--steps", "100000", "--sleep", "0.02"],
                             work / f"{name}.log", env=env)
        try:
            w.wait_for(r"^step 20 ", timeout=120)
            pid = w.pid
            print(f"  tree {w.tree()} cuda pid {pid} state {driver.state(pid).name}", flush=True)
            for cycle in range(3):
                ok = (step(driver, "lock", lambda: driver.lock(pid, 2000), pid)
                      and step(driver, "checkpoint", lambda: driver.checkpoint(pid), pid))
                if ok and with_criu:
                    try:
                        secs = harness.dump(pid, work / f"{name}-{cycle}", leave_running=True)
                        print(f"  criu dump   ok {secs:.2f}s", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"  criu dump   FAILED {str(e)[-1500:]}", flush=True)
                ok = ok and step(driver, "restore", lambda: driver.restore(pid, None), pid)
                ok = ok and step(driver, "unlock", lambda: driver.unlock(pid), pid)
                before = len(w.text())
                time.sleep(1.0)
                moved = len(w.text()) > before
                print(f"  cycle {cycle}: {'OK' if ok else 'FAILED'}; program {'runs on' if moved else 'STOPPED'}"
                      f"{'' if w.alive() else ' (exited: ' + w.text()[-300:] + ')'}", flush=True)
                if not ok or not w.alive():
                    break
        except Exception as e:  # noqa: BLE001
            print(f"  probe failed: {e}", flush=True)
        finally:
            w.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
