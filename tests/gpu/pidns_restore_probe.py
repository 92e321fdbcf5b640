"""Device experiment: a CUDA process started in the host PID namespace (where CUDA works without a private
/proc) is captured, its host pid is then taken by another process, and it is restored inside a NEW PID and
mount namespace (with its own /proc) under its old pid there, the way `criu-ns` restores. Prints each step:
whether the plain restore fails on the taken pid, whether the namespaced restore runs, and whether the GPU
restore and the data check pass there.

Then it is captured again there and restored into another new namespace (the second start).

    python3 tests/gpu/pidns_restore_probe.py WORKDIR [proc|bare]     (bare: a PID namespace only, host /proc)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402


DUMP2_EXTRA = os.environ.get("PNR_DUMP2", "").split()        # criu options tried for the second capture
RESTORE2_EXTRA = os.environ.get("PNR_RESTORE2", "").split()  # and for its restore


def take_pid(pid: int) -> subprocess.Popen | None:
    """A sleeper holding host pid `pid` (ns_last_pid set just below it; a few tries against other forks)."""
    for _ in range(20):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "600"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def in_namespace_of(holder: int, ns_pid: int) -> int | None:
    """The host pid of the process whose innermost pid is `ns_pid`, in holder's PID namespace."""
    want = os.readlink(f"/proc/{holder}/ns/pid")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "ns" / "pid") != want:
                continue
            nspid = [ln for ln in (d / "status").read_text().splitlines() if ln.startswith("NSpid:")][0].split()
            if int(nspid[-1]) == ns_pid:
                return int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def restore_in_new_namespace(img: Path, work: Path, tag: str, mount_proc: bool, ns_pid: int):
    """criu restore -d run inside a new PID namespace (and mount namespace with its own /proc when
    `mount_proc`), whose init then stays as `sleep`. Returns (unshare's Popen, the init's host pid, the
    restored root's host pid)."""
    crv = f"LD_LIBRARY_PATH={harness.CRIU_ENV['LD_LIBRARY_PATH']} {harness.CRIU}"
    rc = work / f"{tag}-rc"
    extra = " ".join(RESTORE2_EXTRA) if tag == "ns2" else ""
    script = (f"{crv} restore -D {img} -o restore-{tag}.log -v2 -d {' '.join(harness.CRIU_OPTS)} {extra}; "
              f"echo criu-rc=$? > {rc}; exec sleep 600")
    t = time.monotonic()
    holder = subprocess.Popen(["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []),
                               "sh", "-c", script])
    while not rc.exists() and time.monotonic() - t < 120:
        time.sleep(0.05)
    print(f"[{tag}] namespaced restore: {rc.read_text().strip()} in {time.monotonic() - t:.2f} s", flush=True)
    init = harness.proctree.children_map().get(holder.pid, [None])[0]
    if "criu-rc=0" not in rc.read_text():
        print(harness._log_tail(img / f"restore-{tag}.log", 12), flush=True)
        return holder, init, None
    host = in_namespace_of(init, ns_pid)
    print(f"[{tag}] restored: host pid", host, "namespace pid", ns_pid, flush=True)
    return holder, init, host


def main() -> int:
    work = harness.fresh_dir(Path(sys.argv[1]))
    mount_proc = (sys.argv[2] if len(sys.argv) > 2 else "proc") == "proc"
    harness.set_subreaper()
    driver = load_driver()
    ctl = harness.fresh_dir(work / "ctl")
    w = harness.Workload([sys.executable, str(Path(__file__).parent / "workload_hold.py"), "--gib", "0.25",
                          "--ctl", str(ctl)], work / "hold.log", ns="none")
    sleeper = None
    started: list = []            # (unshare Popen, init pid) of each namespace made
    try:
        print("READY:", w.wait_for(r"^READY.*$", timeout=60).group(0), "host pid", w.pid,
              "own /proc at restore:", mount_proc, flush=True)
        old = w.pid
        stage = TreeGpuStage.for_tree(w.tree())
        stage.lock_all(2000)
        stage.checkpoint_all()
        record = stage.record()
        print(f"criu dump 1: {harness.dump(old, work / 'img1'):.2f} s", flush=True)
        w.reap_after_dump()
        sleeper = take_pid(old)
        print("old pid", old, "taken by a sleeper:", sleeper is not None, flush=True)
        try:
            harness.restore(work / "img1")
            print("plain restore UNEXPECTEDLY worked", flush=True)
            return 1
        except harness.CriuFailed as e:
            lines = [ln for ln in str(e).splitlines() if "rror" in ln and "RLIMIT" not in ln][:2]
            print("plain restore failed as expected:", " | ".join(lines)[:400], flush=True)
        for generation in (1, 2):
            if generation == 1:
                holder, init, host = restore_in_new_namespace(work / "img1", work, "ns1", mount_proc, old)
                started.append((holder, init))
            else:        # the namespace (its init, its mounts) is in the images now: criu makes it again
                t = time.monotonic()
                p = harness.criu("restore", "-D", str(work / "img2"), "-o", "restore.log", "-v2", "-d",
                                 "--pidfile", str(work / "img2" / "pid"), *harness.CRIU_OPTS, *RESTORE2_EXTRA)
                if p.returncode != 0:
                    print("[ns2] criu restore of the namespace FAILED:", p.stderr[-800:],
                          harness._log_tail(work / "img2" / "restore.log", 12), flush=True)
                    return 1
                init = int((work / "img2" / "pid").read_text())
                started.append((None, init))
                host = in_namespace_of(init, old)
                print(f"[ns2] criu restored the namespace (init {init}) in {time.monotonic() - t:.2f} s; "
                      f"host pid {host}, namespace pid {old}", flush=True)
            if host is None:
                return 1
            for item in record["processes"]:
                item["ns_pid"] = item["pid"] if generation == 1 else old   # host pid at capture 1, then ns pid
            restored = TreeGpuStage.adopt_restored(driver, record, [host])
            t = time.monotonic()
            restored.restore_all(None)
            restored.unlock_all()
            print(f"[ns{generation}] GPU restore + unlock: {time.monotonic() - t:.2f} s", flush=True)
            print(f"[ns{generation}] heartbeats (GPU counter) in 2.5 s after restore: {harness.heartbeats(w)}",
                  flush=True)
            if generation == 2:
                break
            stage = TreeGpuStage.for_tree([host])
            stage.lock_all(2000)
            stage.checkpoint_all()
            record = stage.record()
            print(f"[ns1] capture 2 GPU checkpointed: {record['processes']}", flush=True)
            try:
                (work / "img2").mkdir()
                t = time.monotonic()
                p = harness.criu("dump", "-t", str(init), "-D", str(work / "img2"), "-o", "dump.log", "-v2",
                                 *harness.CRIU_OPTS, *DUMP2_EXTRA)
                if p.returncode != 0:
                    raise harness.CriuFailed(f"{p.stderr[-1500:]}\n{harness._log_tail(work / 'img2' / 'dump.log', 12)}")
                print(f"[ns1] criu dump 2 of the namespaced process ({' '.join(DUMP2_EXTRA)}): "
                      f"{time.monotonic() - t:.2f} s", flush=True)
            except harness.CriuFailed as e:
                lines = [ln for ln in str(e).splitlines() if "rror" in ln][:4]
                print("[ns1] criu dump 2 FAILED:", " | ".join(lines)[:700], flush=True)
                return 1
            time.sleep(0.2)                    # the dump killed the namespace's tree, its init included
        print("after restore:", harness.verify_data(w, ctl), flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - an experiment reports
        return harness.report_failure(w, e)
    finally:
        for holder, init in started:
            if init:
                try:
                    os.kill(init, 9)           # the namespace's init: everything restored in it goes too
                except ProcessLookupError:
                    pass
            if holder is not None:
                holder.kill()
                holder.wait()
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        w.kill()


if __name__ == "__main__":
    sys.exit(main())
