"""Device probe (root, GPU): what driver 580 answers to each checkpoint-API call in each state, what /proc shows
of a CUDA process before/after its GPU checkpoint, lock with work in flight, lock of a SIGSTOPped and of a
cgroup-frozen process, managed (UVM) memory, and the refusal checks of slurmckpt.cuda.stage on real processes.
Prints one line per fact; the fake driver and stage.unsupported_reasons are built from these answers.

    python3 tests/gpu/probe_driver.py WORKDIR
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import GpuDriverError, load_driver  # noqa: E402
from slurmckpt.cuda.procscan import _map_paths, find_cuda_pids, unsupported_reasons  # noqa: E402
from slurmckpt.node.procfs import fd_links  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402

HERE = Path(__file__).resolve().parent


def say(key: str, value: object) -> None:
    print(f"{key}: {json.dumps(value, default=str)}", flush=True)


def call(fn, *args) -> dict:
    t = time.monotonic()
    try:
        r = fn(*args)
        out = {"ok": True, "value": getattr(r, "name", r)}
    except GpuDriverError as e:
        out = {"ok": False, "code": e.code, "result": e.result}
    out["s"] = round(time.monotonic() - t, 4)
    return out


def ops(pid: int, *specs: str, timeout: float = 30) -> list:
    try:
        p = subprocess.run([sys.executable, str(HERE / "driver_ops.py"), str(pid), *specs], capture_output=True,
                           text=True, timeout=timeout)
        return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")] or [p.stderr[-500:]]
    except subprocess.TimeoutExpired as e:
        return [f"TIMEOUT after {timeout}s", (e.stdout or b"").decode(errors="replace")[-800:]]


def nvidia_view(pid: int) -> dict:
    maps = Counter(p for p in _map_paths(pid) if "nvidia" in p or "nccl" in p or "cuda" in p.lower())
    fds = Counter(l for l in fd_links(pid) if "nvidia" in l)
    return {"maps": dict(maps), "fds": dict(fds)}


def main() -> int:
    work = harness.fresh_dir(Path(sys.argv[1]))
    d = load_driver()
    say("driver_version", d.version)
    say("devices", [g.to_dict() for g in d.devices()])
    say("state(self, no CUDA here yet? agent did cuInit)", call(d.state, os.getpid()))
    say("state(pid 1)", call(d.state, 1))
    say("state(missing pid)", call(d.state, 4_000_000))
    say("lock(pid 1)", call(d.lock, 1, 100))

    ctl = harness.fresh_dir(work / "ctl")
    w = harness.Workload([sys.executable, str(HERE / "workload_hold.py"), "--gib", "0.5", "--ctl", str(ctl)],
                         work / "hold.log")
    try:
        w.wait_for(r"^READY")
        pid = w.pid
        say("find_cuda_pids(scan)", find_cuda_pids([pid, os.getpid(), 1]))
        say("unsupported_reasons(torch, 1 GPU)", unsupported_reasons([pid]))
        say("view RUNNING", nvidia_view(pid))
        say("state RUNNING", call(d.state, pid))
        for op in ("unlock", "checkpoint"):
            say(f"{op} while RUNNING", call(getattr(d, op), pid))
        say("restore while RUNNING", call(d.restore, pid, None))
        (ctl / "busy").touch()
        w.wait_for(r"^BUSY")
        say("lock(100ms) with ~1s kernel in flight", call(d.lock, pid, 100))
        say("state after timed-out lock", call(d.state, pid))
        say("lock(5000ms) with kernel in flight", call(d.lock, pid, 5000))
        say("lock again while LOCKED", call(d.lock, pid, 100))
        say("restore while LOCKED", call(d.restore, pid, None))
        say("checkpoint (0.5 GiB)", call(d.checkpoint, pid))
        say("state", call(d.state, pid))
        say("view CHECKPOINTED", nvidia_view(pid))
        say("find_cuda_pids(scan) of a CHECKPOINTED process", find_cuda_pids([pid]))
        say("unlock while CHECKPOINTED", call(d.unlock, pid))
        say("lock while CHECKPOINTED", call(d.lock, pid, 100))
        say("checkpoint while CHECKPOINTED", call(d.checkpoint, pid))
        me = d.devices()[0].uuid
        say("restore with identity pairs", call(d.restore, pid, [(me, me)]))
        say("unlock", call(d.unlock, pid))
        say("view RUNNING again", nvidia_view(pid))

        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        say("SIGSTOPped: lock(2000) checkpoint restore unlock", ops(pid, "lock:2000", "checkpoint", "restore", "unlock"))
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
        say("after SIGCONT", ops(pid, "state"))

        cg = Path("/sys/fs/cgroup")
        if (cg / "cgroup.controllers").exists():
            probe = cg / "slurmckpt-probe"
            try:
                probe.mkdir(exist_ok=True)
                (probe / "cgroup.procs").write_text(str(pid))
                (probe / "cgroup.freeze").write_text("1")
                time.sleep(0.3)
                say("cgroup.events", (probe / "cgroup.events").read_text().split())
                say("cgroup-frozen: lock(2000) checkpoint restore unlock",
                    ops(pid, "lock:2000", "checkpoint", "restore", "unlock", timeout=60))
                say("cgroup-frozen after that: state", ops(pid, "state"))
                (probe / "cgroup.freeze").write_text("0")
                time.sleep(0.3)
                say("thawed: state", ops(pid, "state"))
                say("lock+checkpoint, then freeze, restore+unlock while frozen", None)
                say(" running: lock checkpoint", ops(pid, "lock:2000", "checkpoint"))
                (probe / "cgroup.freeze").write_text("1")
                time.sleep(0.3)
                say(" frozen: restore unlock", ops(pid, "restore", "unlock", timeout=60))
                (probe / "cgroup.freeze").write_text("0")
                time.sleep(0.3)
                say(" thawed: state", ops(pid, "state", "restore", "unlock", "state"))
            except OSError as e:
                say("cgroup v2 freeze probe", f"skipped: {e}")
            finally:
                try:
                    (probe / "cgroup.freeze").write_text("0")
                    (cg / "cgroup.procs").write_text(str(pid))
                    probe.rmdir()
                except OSError as e:
                    say("cgroup cleanup", str(e))
        else:
            say("cgroup v2", "absent")
        bogus = "GPU-" + str(uuid.uuid4())
        say("cycle 2 lock+checkpoint", [call(d.lock, pid, 2000), call(d.checkpoint, pid)])
        say("bad pairs: to an absent GPU / from an unknown GPU, then NULL restore + unlock",
            ops(pid, f"restore:pairs={me}>{bogus}", "state", f"restore:pairs={bogus}>{me}", "state",
                "restore", "unlock", "state"))
        (ctl / "verify").touch()
        m = w.wait_for(r"^DATA (OK|BAD).*$")
        say("data after all that", m.group(0))
        w.wait_exit(30)
    finally:
        w.kill()

    for managed in (False, True):
        tag = "managed" if managed else "plain"
        m = harness.Workload([sys.executable, str(HERE / "workload_managed.py")] + (["--managed"] if managed else []),
                             work / f"cupy-{tag}.log")
        try:
            m.wait_for(r"^READY", timeout=60)
            say(f"cupy {tag}: view", nvidia_view(m.pid))
            say(f"cupy {tag}: uvm maps detail", [l for l in open(f"/proc/{m.pid}/maps") if "nvidia-uvm" in l][:12])
            say(f"cupy {tag}: unsupported_reasons", unsupported_reasons([m.pid]))
            say(f"cupy {tag}: lock checkpoint restore unlock",
                ops(m.pid, "lock:2000", "checkpoint", "state", "restore", "unlock", "state", timeout=60))
        except Exception as e:   # noqa: BLE001 - a probe reports and goes on
            say(f"cupy {tag}", f"error {e}")
        finally:
            m.kill()

    # a TreeGpuStage refusal on a real process: NCCL loaded with 2 ranks per node and no NCCL_*_DISABLE
    n = harness.Workload([sys.executable, str(HERE / "workload_hold.py"), "--gib", "0.1", "--ctl", str(ctl)],
                         work / "nccl.log", env={"LOCAL_WORLD_SIZE": "2"})
    try:
        n.wait_for(r"^READY")
        try:
            TreeGpuStage.for_tree([n.pid])
            say("stage refusal (LOCAL_WORLD_SIZE=2, no NCCL env)", "NOT refused")
        except Exception as e:   # noqa: BLE001
            say("stage refusal (LOCAL_WORLD_SIZE=2, no NCCL env)", f"{type(e).__name__}: {e}")
    finally:
        n.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
