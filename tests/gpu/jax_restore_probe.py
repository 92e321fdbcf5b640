"""Device experiment (root, GPU, outside Slurm): why the GPU restore of a criu-restored JAX process fails
(cuCheckpointProcessGetState -> CUDA_ERROR_OPERATING_SYSTEM (304) under Slurm, 2026-12-04) while PyTorch's
passes. Each CASE is PROGRAM-MODE: the program runs to step 20, then GPU lock + checkpoint, criu dump (the
process dies), criu restore -d in the host PID namespace under its own pid, GPU restore + unlock, and whether
it runs on; /proc is read at each step. MODE is how the restored process waits for its GPU restore:

  thawed   as slurmckpt's agent does: criu leaves every thread running, then GetState / Restore / Unlock
  inplace  a periodic capture, three times: criu dump --leave-running between GPU checkpoint and GPU
           restore, the process is not killed (variant -freeze: in a cgroup v2 frozen around the dump, as the
           agent does)
  stopped  as CRIU's cuda_plugin does: criu restore --leave-stopped; only the driver's restore thread
           (cuCheckpointProcessGetRestoreThreadId, read before the dump) is let run, through ptrace, for
           GetState / Restore / Unlock; then the whole process is continued

What it tells apart: (1) the restored process dies before or during its GPU restore (a thread runs into state
the GPU restore has not re-created yet): liveness and GetState at 0..3 s after criu, the exit status, the
faulthandler tracebacks in its log, dmesg; (2) the driver's restore thread stuck or missing after criu: its
/proc state, wchan and syscall before the dump and after the restore; (3) timing: GetState is retried over 3 s;
(4) what the process holds: /dev/nvidia* fds and maps, anon inodes, memfd, sockets, threads by name, at each
step; 'stopped' working where 'thawed' fails points at (1) and is the fix to build.

    python3 tests/gpu/jax_restore_probe.py WORKDIR [CASE...]   (default: jax-thawed jax-stopped torch-thawed torch-stopped)

A CASE may end in -1cpu (the program pinned to one CPU, as Slurm's cpuset pins a one-CPU job) and/or -user
(the program runs as $PROBE_USER, default ckptgpu) and/or -pidns (pid 1 of its own PID + mount namespace). tests/gpu/probe_in_slurm.sh runs the probe inside a
Slurm job.
"""
from __future__ import annotations

import collections
import ctypes
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from slurmckpt.cuda.driver import GpuDriverError, load_driver, result_name  # noqa: E402

HERE = Path(__file__).resolve().parent
PROGRAMS = {
    "jax": ("workload_jax.py", {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0",
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONFAULTHANDLER": "1"}),
    "torch": ("workload_train.py", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONFAULTHANDLER": "1"}),
}
PTRACE_CONT, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 7, 17, 0x4206, 0x4207
WALL = 0x40000000
T0 = time.monotonic()

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long


def say(*parts: object) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *parts, flush=True)


def ptrace(req: int, tid: int) -> None:
    if libc.ptrace(req, tid, None, None) == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"ptrace({req:#x}, {tid}): {os.strerror(e)}")


def wait_stop(tid: int, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(tid, os.WNOHANG | WALL)
        if got == tid:
            if os.WIFSTOPPED(status):
                return f"stopped sig={os.WSTOPSIG(status)} event={status >> 16}"
            return f"not stopped: status {status:#x}"
        time.sleep(0.01)
    return "no stop within timeout"


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as e:
        return f"<{e.strerror}>"


class Cuda:
    """The driver's checkpoint calls (slurmckpt.cuda.driver), each with a watchdog (a call on a stopped
    process hangs on driver 580), answered as text: the state, "ok", or the CUresult's name."""

    def __init__(self) -> None:
        self.driver = load_driver()
        self.rtid_fn = getattr(self.driver._lib, "cuCheckpointProcessGetRestoreThreadId", None)
        if self.rtid_fn is not None:
            self.rtid_fn.argtypes, self.rtid_fn.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int

    @staticmethod
    def timed(fn, timeout: float) -> str:
        box: list[str] = []
        t = time.monotonic()

        def answer() -> None:
            try:
                box.append(fn())
            except GpuDriverError as e:
                box.append(e.result)
        th = threading.Thread(target=answer, daemon=True)
        th.start()
        th.join(timeout)
        return f"{box[0] if box else f'HANG (no answer in {timeout:.0f} s)'} [{time.monotonic() - t:.2f}s]"

    def state(self, pid: int, timeout: float = 10) -> str:
        return self.timed(lambda: self.driver.state(pid).name, timeout)

    def restore_tid(self, pid: int, timeout: float = 10) -> str:
        if self.rtid_fn is None:
            return "no cuCheckpointProcessGetRestoreThreadId in libcuda"

        def call() -> str:
            out = ctypes.c_int(0)
            rc = self.rtid_fn(pid, ctypes.pointer(out))
            return str(out.value) if rc == 0 else result_name(rc)
        return self.timed(call, timeout)

    def op(self, name: str, pid: int, timeout: float = 60) -> str:
        def call() -> str:
            if name == "lock":
                self.driver.lock(pid, timeout_ms=10_000)
            else:
                getattr(self.driver, name)(pid)
            return "ok"
        return self.timed(call, timeout)


def threads(pid: int) -> list[tuple[int, str, str, str]]:
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        stat = read(f"{base}/stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        out.append((tid, read(f"{base}/comm").strip(), state, read(f"{base}/wchan").strip()))
    return out


def view(tag: str, pid: int, rtid: int | None) -> None:
    """Threads by name and state, the restore thread in detail, fds and maps that are not plain files."""
    ths = threads(pid)
    if not ths:
        say(f"  {tag}: pid {pid} has no /proc entry ({read(f'/proc/{pid}/stat')[:80]})")
        return
    by = collections.defaultdict(list)
    for _, comm, state, _ in ths:
        by[comm].append(state)
    st = read(f"/proc/{pid}/status")
    fields = {ln.split(":")[0]: ln.split(":", 1)[1].strip() for ln in st.splitlines() if ":" in ln}
    say(f"  {tag}: State {fields.get('State')} NSpid {fields.get('NSpid')} RssAnon {fields.get('RssAnon')} "
        f"SigBlk/SigPnd/ShdPnd {fields.get('SigBlk')}/{fields.get('SigPnd')}/{fields.get('ShdPnd')}; {len(ths)} threads: "
        + ", ".join(f"{c} x{len(s)} [{''.join(sorted(s))}]" for c, s in sorted(by.items())))
    for tid, comm, state, wchan in ths:
        if tid == rtid:
            base = f"/proc/{pid}/task/{tid}"
            say(f"  {tag}: restore thread {tid} ({comm}) state {state} wchan {wchan} syscall "
                f"{read(base + '/syscall').strip()[:60]} SigBlk {_field(read(base + '/status'), 'SigBlk')}")
    kinds: collections.Counter = collections.Counter()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(("/dev/", "anon_inode:", "/memfd:")):
            kinds[link.split(" (")[0]] += 1
        elif link.startswith(("socket:", "pipe:")):
            kinds[link.split(":")[0]] += 1
        else:
            kinds["file"] += 1
    maps: collections.Counter = collections.Counter()
    sizes: collections.Counter = collections.Counter()
    for ln in read(f"/proc/{pid}/maps").splitlines():
        parts = ln.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(("/dev/", "/memfd:", "[anon:")):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            key = f"{parts[5].split(' (')[0]} {parts[1]}"
            maps[key] += 1
            sizes[key] += hi - lo
    say(f"  {tag}: fds {dict(sorted(kinds.items()))}")
    say(f"  {tag}: maps " + (", ".join(f"{k} x{n} {sizes[k] >> 10} KiB" for k, n in sorted(maps.items())) or "none"))


def _field(status: str, name: str) -> str:
    return next((ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith(name + ":")), "?")


def reaped(pid: int) -> str | None:
    """The exit of `pid` (our child: the restored root re-parents to this subreaper) if it ended, else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:     # not our child (the namespace's init under unshare): alive while /proc has it
        return None if os.path.exists(f"/proc/{pid}/stat") and read(f"/proc/{pid}/stat").split(") ")[-1][:1] != "Z" \
            else "gone (not our child)"
    if got != pid:
        return None
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}" + (" (core)" if os.WCOREDUMP(status) else "")
    return f"exited {os.WEXITSTATUS(status)}"


def restore(images: Path, extra: list[str]) -> tuple[int, float]:
    pidfile = images / "restore.pid"
    t = time.monotonic()
    p = harness.criu("restore", "-D", str(images), "-o", "restore.log", "-v2", "-d", "--pidfile", str(pidfile),
                     *harness.CRIU_OPTS, *extra)
    if p.returncode != 0:
        raise harness.CriuFailed(f"criu restore rc={p.returncode}\n{p.stderr[-1500:]}\n"
                                 f"{harness._log_tail(images / 'restore.log', 15)}")
    return int(pidfile.read_text().strip()), time.monotonic() - t


def steps(w: harness.Workload) -> int:
    return w.text().count("\nstep ")


def runs_on(w: harness.Workload, pid: int, tag: str) -> None:
    n0 = steps(w)
    time.sleep(3.0)
    n1, end = steps(w), reaped(pid)
    say(f"  {tag}: {n1 - n0} step lines in the 3 s after the GPU restore; "
        f"{'process ' + end if end else 'alive'}; state {cuda_state(pid)}")
    if end or n1 == n0:
        say("  log tail:\n" + "\n".join(w.text().splitlines()[-25:]))


cuda: Cuda


def cuda_state(pid: int) -> str:
    return cuda.state(pid, 5)


def in_place(w: harness.Workload, pid: int, images: Path, freeze: bool) -> None:
    """A periodic capture as the agent takes it, three times: (lock + checkpoint done), [cgroup v2 freeze],
    criu dump --leave-running [--freeze-cgroup], [thaw], GPU restore + unlock; the program must run on."""
    cg = Path("/sys/fs/cgroup") / f"probe-{images.name}"
    if freeze:
        cg.mkdir(exist_ok=True)
        (cg / "cgroup.procs").write_text(str(pid))
    for cycle in (1, 2, 3):
        if cycle > 1:
            say(f"  [{cycle}] lock: {cuda.op('lock', pid)}; checkpoint: {cuda.op('checkpoint', pid)}")
        extra = []
        if freeze:
            (cg / "cgroup.freeze").write_text("1")
            while "frozen 1" not in (cg / "cgroup.events").read_text():
                time.sleep(0.002)
            extra = ["--freeze-cgroup", str(cg)]
        img = images.with_name(f"{images.name}-{cycle}")
        img.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        p = harness.criu("dump", "-t", str(pid), "-D", str(img), "-o", "dump.log", "-v2", *harness.CRIU_OPTS,
                         "--leave-running", *extra)
        say(f"  [{cycle}] criu dump --leave-running{' (frozen)' if freeze else ''}: rc {p.returncode}, "
            f"{time.monotonic() - t:.2f} s")
        if freeze:
            (cg / "cgroup.freeze").write_text("0")
        end = reaped(pid)
        say(f"  [{cycle}] after the dump: {'process ' + end if end else 'alive'}; GetState {cuda_state(pid)}")
        if end:
            return
        say(f"  [{cycle}] restore: {cuda.op('restore', pid)}; state {cuda_state(pid)}; "
            f"unlock: {cuda.op('unlock', pid)}")
        runs_on(w, pid, f"[{cycle}] in place")


def case(name: str, work: Path) -> None:
    prog, mode, *variant = name.split("-")
    script, env = PROGRAMS[prog]
    say(f"=== {name}")
    # variant 1cpu: one CPU, as Slurm's cpuset gives a job without --cpus-per-task; user: the program runs as
    # $PROBE_USER (default ckptgpu), as a job's does, the probe's CUDA and criu calls stay root's
    pin = ["taskset", "-c", "0"] if "1cpu" in variant else []
    if "user" in variant:
        pw = pwd.getpwnam(os.environ.get("PROBE_USER", "ckptgpu"))
        pin += ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
        env = {**env, "HOME": "/tmp"}
        work.chmod(0o755)                              # criu reopens the log as the restored program
        (work / f"{name}.log").touch()
        os.chown(work / f"{name}.log", pw.pw_uid, pw.pw_gid)
    # variant pidns: the program is pid 1 of its own PID + mount namespace, as a slurmckpt task's tree is (criu
    # needs SLURMCKPT_CRIU_EXTRA="--ext-mount-map auto --enable-external-sharing --enable-external-masters")
    w = harness.Workload([*pin, sys.executable, str(HERE / script), "--steps", "100000", "--sleep", "0.05"],
                         work / f"{name}.log", env=env, ns="pid+proc+fds" if "pidns" in variant else "none")
    try:
        w.wait_for(r"^step 20 ", timeout=180)
        pid = w.pid
        rt = cuda.restore_tid(pid)
        rtid = int(rt.split()[0]) if rt.split()[0].isdigit() else None
        say(f"  pid {pid}, restore thread: {rt}")
        view("running", pid, rtid)
        say(f"  lock: {cuda.op('lock', pid)}; checkpoint: {cuda.op('checkpoint', pid)}; state {cuda_state(pid)}")
        view("checkpointed", pid, rtid)
        if mode == "inplace":
            in_place(w, pid, work / name, freeze="freeze" in variant)
            return
        img = work / f"{name}-img"
        say(f"  criu dump: {harness.dump(pid, img):.2f} s; "
            f"dump.log warnings: {sum('Warn' in ln for ln in (img / 'dump.log').read_text().splitlines())}")
        for ln in [ln for ln in (img / "dump.log").read_text().splitlines() if "Warn" in ln][:4]:
            say("    " + ln.strip()[:200])
        w.reap_after_dump()
        new, secs = restore(img, ["--leave-stopped"] if mode == "stopped" else [])
        w.adopt(new)
        say(f"  criu restore{' --leave-stopped' if mode == 'stopped' else ''}: {secs:.2f} s, pid {new}")
        if mode == "thawed":
            t = time.monotonic()
            got = ""
            for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 3.0):
                time.sleep(max(0.0, t + delay - time.monotonic()))
                end = reaped(new)
                got = cuda_state(new) if not end else "-"
                say(f"  +{delay:.2f}s: {'process ' + end if end else 'alive'}; GetState {got}; "
                    f"restore thread {cuda.restore_tid(new, 5) if not end else '-'}")
                if delay == 0.0 or end:
                    view(f"restored +{delay:.2f}s", new, rtid)
                if end:
                    say("  log tail:\n" + "\n".join(w.text().splitlines()[-40:]))
                    return
                if got.startswith("CHECKPOINTED") and delay >= 0.2:
                    break
            say(f"  restore: {cuda.op('restore', new)}; state {cuda_state(new)}; unlock: {cuda.op('unlock', new)}")
            runs_on(w, new, "thawed")
            return
        view("restored, stopped", new, rtid)
        if rtid is None:
            say("  no restore thread id: cannot run it alone; skipped")
            return
        ptrace(PTRACE_SEIZE, rtid)
        say(f"  seized restore thread {rtid}: {wait_stop(rtid)}")
        ptrace(PTRACE_CONT, rtid)
        time.sleep(0.05)
        say(f"  restore thread running alone: {[(t, s) for t, _, s, _ in threads(new) if t == rtid]}, "
            f"other threads: {collections.Counter(s for t, _, s, _ in threads(new) if t != rtid)}")
        say(f"  GetState {cuda_state(new)}; GetRestoreThreadId {cuda.restore_tid(new, 5)}")
        say(f"  restore: {cuda.op('restore', new)}; state {cuda_state(new)}; unlock: {cuda.op('unlock', new)}; "
            f"state {cuda_state(new)}")
        ptrace(PTRACE_INTERRUPT, rtid)
        say(f"  interrupted restore thread: {wait_stop(rtid)}")
        ptrace(PTRACE_DETACH, rtid)
        os.kill(new, signal.SIGCONT)
        runs_on(w, new, "stopped")
    except Exception as e:  # noqa: BLE001 - an experiment reports
        say(f"  FAILED: {type(e).__name__}: {str(e)[:2500]}")
        say("  log tail:\n" + "\n".join(w.text().splitlines()[-15:]))
    finally:
        w.kill()


def main() -> int:
    global cuda
    work = harness.fresh_dir(Path(sys.argv[1]))
    harness.set_subreaper()
    cuda = Cuda()
    for name in sys.argv[2:] or ["jax-thawed", "jax-stopped", "torch-thawed", "torch-stopped"]:
        case(name, work)
    out = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
    say("dmesg (segfault/NVRM/traps, last 20):")
    for ln in [ln for ln in out if any(k in ln for k in ("segfault", "NVRM", "trap", "python"))][-20:]:
        print("   ", ln, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
