"""Hand-driven capture/restore for the GPU proofs (device machine, root): workloads in their own PID namespace,
criu run directly, GPU steps through slurmckpt.cuda. The process running this is the subreaper that the
restored tree re-parents to (as the task's wrapper is in production).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from slurmckpt.node import proctree  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402

CARRY = REPO / ".carry" / "criu"
CRIU = os.environ.get("SLURMCKPT_CRIU") or str(CARRY / "criu")
CRIU_ENV = {**os.environ, "LD_LIBRARY_PATH": str(CARRY)}
CRIU_OPTS = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--manage-cgroups=ignore",
             *os.environ.get("SLURMCKPT_CRIU_EXTRA", "").split()]      # experiments: more options, both ways
PR_SET_CHILD_SUBREAPER = 36


def set_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def criu(*args: str, timeout: float = 580) -> subprocess.CompletedProcess:
    return subprocess.run([CRIU, *args], env=CRIU_ENV, capture_output=True, text=True, timeout=timeout)


class CriuFailed(RuntimeError):
    pass


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def dump(pid: int, images: Path, leave_running: bool = False, extra: list[str] | None = None) -> float:
    images.mkdir(parents=True, exist_ok=True)
    args = ["dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v2", *CRIU_OPTS, *(extra or [])]
    if leave_running:
        args.append("--leave-running")
    t = time.monotonic()
    p = criu(*args)
    dt = time.monotonic() - t
    if p.returncode != 0:
        raise CriuFailed(f"criu dump rc={p.returncode}\n{p.stderr[-2000:]}\n{_log_tail(images / 'dump.log')}")
    return dt


def restore(images: Path) -> tuple[int, float]:
    """criu restore -d from this (subreaper) process; returns (host pid of the restored root, seconds)."""
    pidfile = images / "restore.pid"
    pidfile.unlink(missing_ok=True)
    t = time.monotonic()
    p = criu("restore", "-D", str(images), "-o", "restore.log", "-v2", "-d", "--pidfile", str(pidfile),
             *CRIU_OPTS)
    dt = time.monotonic() - t
    if p.returncode != 0:
        raise CriuFailed(f"criu restore rc={p.returncode}\n{p.stderr[-2000:]}\n{_log_tail(images / 'restore.log')}")
    return int(pidfile.read_text().strip()), dt


NAMESPACES = {
    "none": ["setsid"],                                           # restored under its old host pid
    "pid": ["unshare", "--pid", "--fork", "setsid"],              # CUDA init fails here (304): /proc is the host's
    "pid+proc": ["unshare", "--pid", "--fork", "--mount-proc", "setsid"],
    # the same, with stdin and the log opened inside the namespace: criu finds every fd's mount in it
    "pid+proc+fds": ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                     'exec setsid "$@" </dev/null >>"$PROBE_LOG" 2>&1', "sh"],
}


class Workload:
    """A command run as `setsid CMD`, or in its own PID namespace (CMD = its init); stdout+stderr to `log`.
    Driver 580 fails cuInit with CUDA_ERROR_OPERATING_SYSTEM in a new PID namespace that still sees the
    host's /proc (seen on the H200), so GPU workloads run with ns="none" or "pid+proc"."""

    def __init__(self, argv: list[str], log: Path, ns: str = "none", env: dict[str, str] | None = None):
        self.log = log
        out = open(log, "ab")
        prefix = NAMESPACES[ns]
        self.outer = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      env={**os.environ, "PROBE_LOG": str(log), **(env or {})})
        out.close()
        self.pidns = ns != "none"
        self.pid = self._find_root()
        self.restored = False

    def _find_root(self) -> int:
        if not self.pidns:
            return self.outer.pid
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kids = proctree.children_map().get(self.outer.pid, [])
            if kids:
                return kids[0]
            time.sleep(0.01)
        raise RuntimeError("workload root did not appear")

    def tree(self) -> list[int]:
        return proctree.descendants(self.pid)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120, after: int = 0) -> re.Match:
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.text(), after)
            if m:
                return m
            if not self.alive():
                m = rx.search(self.text(), after)
                if m:
                    return m
                raise RuntimeError(f"workload exited before /{pattern}/:\n{self.text()[-3000:]}")
            time.sleep(0.005)
        raise TimeoutError(f"no /{pattern}/ within {timeout}s:\n{self.text()[-3000:]}")

    def wait_growth(self, size: int, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log.stat().st_size > size:
                return time.monotonic()
            time.sleep(0.001)
        raise TimeoutError("workload did not run after restore")

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        try:   # a zombie child of ours is not alive
            return not open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return False

    def reap_after_dump(self) -> None:
        """After a dump without --leave-running: collect the dead tree (unshare, or the restored root)."""
        if self.restored:
            _waitpid_quiet(self.pid, 30)
        else:
            self.outer.wait(timeout=30)

    def adopt(self, pid: int) -> None:
        self.pid, self.restored = pid, True

    def wait_exit(self, timeout: float = 300) -> int:
        if not self.restored:
            return self.outer.wait(timeout=timeout)
        return _waitpid_quiet(self.pid, timeout)

    def kill(self) -> None:
        for pid in [self.pid] + ([self.outer.pid] if not self.restored else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.wait_exit(10)
        except Exception:
            pass


def _waitpid_quiet(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return -1
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    raise TimeoutError(f"pid {pid} did not exit")


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def drop_caches() -> None:
    """Empty the page cache (after a sync) so that what is read next comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def heartbeats(w: "Workload", seconds: float = 2.5) -> int:
    """`hb` lines the workload prints in `seconds` from now (workload_hold.py bumps a GPU counter for each)."""
    size = w.log.stat().st_size
    time.sleep(seconds)
    return w.log.read_text(errors="replace")[size:].count("hb ")


def verify_data(w: "Workload", ctl: Path) -> str:
    """workload_hold.py recomputes its checksum and ends: its `DATA OK|BAD` line."""
    (ctl / "verify").touch()
    return w.wait_for(r"^DATA (OK|BAD).*$", timeout=60).group(0)


def report_failure(w: "Workload", e: Exception) -> int:
    print(f"FAILED: {type(e).__name__}: {e}"[:3000], flush=True)
    print(w.text()[-1500:])
    return 1


def gpu_checkpoint(tree: list[int]) -> dict:
    """slurmckpt's GPU capture of a tree as the agent runs it (lock every process, then checkpoint them);
    returns the record that TreeGpuStage.adopt_restored needs after the criu restore."""
    stage = TreeGpuStage.for_tree(tree, context={"rank": 0})
    stage.lock_all(2000)
    stage.checkpoint_all()
    return stage.record()
