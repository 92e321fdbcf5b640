"""Device experiment (root, GPU, outside Slurm): why a JAX process in its own PID + mount namespace loses its
GPU state at slurmckpt's in-place capture (GPU lock + checkpoint, [freeze], criu dump --leave-running, [thaw],
GPU restore + unlock) while PyTorch does not (benchmarks/results/gpu-h200-notebook.md, 2026-12-06 section).

Each CASE is PROGRAM-STEP[-host]: the program (jax|torch, tests/gpu/jax_restore_probe.py's) runs to step 20
as pid 1 of its own PID + mount namespace (-host: in the host PID namespace) inside a cgroup v2 of its own;
then three cycles of: GPU lock + checkpoint, freeze, STEP, thaw, GPU restore + unlock, 3 s of steps. STEP:

  nocriu   nothing (the process is only frozen for 1 s): is criu needed for the loss at all?
  seize    PTRACE_SEIZE + INTERRUPT + DETACH of every thread, no parasite, registers untouched
  eintr    as seize, but each thread stopped in a syscall gets compel's register edit
           (compel/arch/x86/src/lib/infect.c: -ERESTART_RESTARTBLOCK -> -EINTR, others rewound to restart)
  dump     criu dump --leave-running --freeze-cgroup (= the agent's capture; the control)
  stopped  criu dump --leave-stopped --freeze-cgroup, thaw (the tree stays SIGSTOPped), only the driver's
           restore thread let run (ptrace) for GPU restore + unlock, then SIGCONT: CRIU's cuda_plugin order
           (plugins/cuda/cuda_plugin.c resume_device: "the resuming process has to stay frozen")
  child    as dump, but the program is pid 2 under a shell init, not pid 1 of the namespace

Every case names the threads it stopped in a syscall (tid, name, syscall number), the threads criu reported as
"Will restore N with interrupted system call", and the thread of any segfault in dmesg, and ends in one line
`VERDICT <case>: ...`. criu needs SLURMCKPT_CRIU_EXTRA="--ext-mount-map auto --enable-external-sharing
--enable-external-masters" for the namespace cases (run_device.sh jaxwhy sets it).

    python3 tests/gpu/jax_why_probe.py WORKDIR [CASE...]
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import jax_restore_probe as jrp  # noqa: E402
from jax_restore_probe import PTRACE_CONT, PTRACE_DETACH, PTRACE_INTERRUPT, PTRACE_SEIZE, ptrace, say  # noqa: E402
from slurmckpt.node import proctree  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT = ["jax-nocriu", "jax-seize", "jax-eintr", "jax-dump", "jax-stopped", "jax-child", "torch-stopped"]
PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
RAX, ORIG_RAX, RIP = 10, 15, 16                      # x86_64 struct user_regs_struct, 27 words
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK, EINTR = 512, 513, 514, 516, 4
Regs = ctypes.c_ulonglong * 27
# JAX as pid 2: a shell is the namespace's init and waits for it (stdio opened inside the namespace)
harness.NAMESPACES["pid+proc+fds+child"] = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                                            'exec </dev/null >>"$PROBE_LOG" 2>&1; setsid "$@" & wait', "sh"]


def signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def names(pid: int) -> dict[int, str]:
    """tid -> 'comm (syscall N)' for every thread of `pid` now (host tids)."""
    out = {}
    for tid, comm, state, _ in jrp.threads(pid):
        sc = jrp.read(f"/proc/{pid}/task/{tid}/syscall").split()
        out[tid] = f"{comm} [{state} syscall {sc[0] if sc else '?'}]"
    return out


def seize_all(pid: int, edit: bool) -> list[str]:
    """Seize + interrupt every thread, optionally apply compel's restart edit, detach. Returns what it saw."""
    seen, tids = [], [t for t, *_ in jrp.threads(pid)]
    for tid in tids:
        ptrace(PTRACE_SEIZE, tid)
        ptrace(PTRACE_INTERRUPT, tid)
    for tid in tids:
        st = jrp.wait_stop(tid)
        regs = Regs()
        if jrp.libc.ptrace(PTRACE_GETREGS, tid, None, ctypes.byref(regs)) == -1:
            seen.append(f"{tid}: {st}, GETREGS failed")
            continue
        orig, rax = signed(regs[ORIG_RAX]), signed(regs[RAX])
        if orig >= 0 and -rax in (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK):
            what = "RESTARTBLOCK" if -rax == ERESTART_RESTARTBLOCK else f"restart {-rax}"
            if edit:
                if -rax == ERESTART_RESTARTBLOCK:
                    regs[RAX] = (-EINTR) & ((1 << 64) - 1)
                else:
                    regs[RAX], regs[RIP] = regs[ORIG_RAX], regs[RIP] - 2
                jrp.libc.ptrace(PTRACE_SETREGS, tid, None, ctypes.byref(regs))
            seen.append(f"{tid} in syscall {orig} ({what}{', edited' if edit else ''})")
    for tid in tids:
        ptrace(PTRACE_DETACH, tid)
    return seen


def freeze(cg: Path, on: bool) -> None:
    (cg / "cgroup.freeze").write_text("1" if on else "0")
    while f"frozen {int(on)}" not in (cg / "cgroup.events").read_text():
        time.sleep(0.002)


def segfaults(since: int, tnames: dict[int, str]) -> list[str]:
    lines = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()[since:]
    out = []
    for ln in lines:
        m = re.search(r"\[(\d+)\]: segfault at (\S+) ip \S+ sp \S+ error (\d+) in (\S+?)\[([0-9a-f]+)", ln)
        if m:
            out.append(f"tid {m[1]} ({tnames.get(int(m[1]), 'not seen')}) read {m[2]} err {m[3]} in {m[4]}+{m[5]}")
    return out


def run_case(name: str, work: Path) -> str:
    prog, step, *var = name.split("-")
    script, env = jrp.PROGRAMS[prog]
    ns = "none" if "host" in var else ("pid+proc+fds+child" if step == "child" else "pid+proc+fds")
    say(f"=== {name} (namespace {ns})")
    w = harness.Workload([sys.executable, str(HERE / script), "--steps", "100000", "--sleep", "0.05"],
                         work / f"{name}.log", env=env, ns=ns)
    dmesg0 = len(subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines())
    cg = Path("/sys/fs/cgroup") / f"probe-why-{name}"
    tnames: dict[int, str] = {}
    try:
        w.wait_for(r"^step 20 ", timeout=180)
        gpu = w.pid if step != "child" else proctree.children_map().get(w.pid, [0])[0]
        cg.mkdir(exist_ok=True)
        for p in [w.pid, *w.tree()]:
            (cg / "cgroup.procs").write_text(str(p))
        rt = jrp.cuda.restore_tid(gpu)
        rtid = int(rt.split()[0]) if rt.split()[0].isdigit() else None
        say(f"  program pid {gpu} (NSpid {jrp._field(jrp.read(f'/proc/{gpu}/status'), 'NSpid')}), "
            f"criu root {w.pid}, restore thread {rt}")
        for cycle in (1, 2, 3):
            say(f"  [{cycle}] lock: {jrp.cuda.op('lock', gpu)}; checkpoint: {jrp.cuda.op('checkpoint', gpu)}")
            tnames.update(names(gpu))
            freeze(cg, True)
            extra: list[str] = []
            t = time.monotonic()
            if step == "nocriu":
                time.sleep(1.0)
            elif step in ("seize", "eintr"):
                for ln in seize_all(gpu, edit=step == "eintr"):
                    say(f"  [{cycle}]   {ln}: {tnames.get(int(ln.split()[0].rstrip(':')), '?')}")
            else:
                img = work / f"{name}-{cycle}"
                img.mkdir(parents=True, exist_ok=True)
                leave = "--leave-stopped" if step == "stopped" else "--leave-running"
                p = harness.criu("dump", "-t", str(w.pid), "-D", str(img), "-o", "dump.log", "-v2",
                                 *harness.CRIU_OPTS, leave, "--freeze-cgroup", str(cg))
                log = (img / "dump.log").read_text(errors="replace") if (img / "dump.log").exists() else ""
                intr = [int(x) for x in re.findall(r"Will restore (\d+) with interrupted system call", log)]
                extra = [f"{x} {tnames.get(x, '?')}" for x in intr]
                say(f"  [{cycle}] criu dump {leave}: rc {p.returncode}; interrupted: {extra or 'none'}")
                if p.returncode != 0:
                    say("  " + "\n  ".join(log.splitlines()[-8:]))
            say(f"  [{cycle}] {step} took {time.monotonic() - t:.2f} s")
            freeze(cg, False)
            end = jrp.reaped(gpu)
            # a driver call on a stopped process hangs (driver 580): GetState only once something runs
            state = "-" if step == "stopped" else jrp.cuda_state(gpu)
            say(f"  [{cycle}] after thaw: {'process ' + end if end else 'alive'}; GetState {state}")
            if end:
                return verdict(name, cycle, f"process {end} before the GPU restore", dmesg0, tnames)
            if step == "stopped":
                if rtid is None:
                    return f"VERDICT {name}: no restore thread id, cannot run it alone"
                ptrace(PTRACE_SEIZE, rtid)
                say(f"  [{cycle}] restore thread {rtid}: {jrp.wait_stop(rtid)}")
                ptrace(PTRACE_CONT, rtid)
            res = f"restore: {jrp.cuda.op('restore', gpu)}; unlock: {jrp.cuda.op('unlock', gpu)}"
            if step == "stopped":
                ptrace(PTRACE_INTERRUPT, rtid)
                jrp.wait_stop(rtid)
                ptrace(PTRACE_DETACH, rtid)
                os.kill(gpu, signal.SIGCONT)
            n0 = jrp.steps(w)
            time.sleep(3.0)
            end, n = jrp.reaped(gpu), jrp.steps(w) - n0
            say(f"  [{cycle}] {res}; {n} steps in 3 s; {'process ' + end if end else 'alive'}; "
                f"state {jrp.cuda_state(gpu)}")
            if end or n == 0:
                say("  log tail:\n" + "\n".join(w.text().splitlines()[-12:]))
                return verdict(name, cycle, f"{res}, then {n} steps, {'process ' + end if end else 'alive'}",
                               dmesg0, tnames)
        return f"VERDICT {name}: SURVIVES 3 of 3 cycles"
    except Exception as e:  # noqa: BLE001 - an experiment reports
        say("  log tail:\n" + "\n".join(w.text().splitlines()[-12:]))
        return verdict(name, 0, f"probe error {type(e).__name__}: {str(e)[:300]}", dmesg0, tnames)
    finally:
        try:
            freeze(cg, False)
        except OSError:
            pass
        w.kill()
        try:
            cg.rmdir()
        except OSError:
            pass


def verdict(name: str, cycle: int, what: str, dmesg0: int, tnames: dict[int, str]) -> str:
    segv = segfaults(dmesg0, tnames)
    return f"VERDICT {name}: DIES at cycle {cycle}: {what}" + (f"; segfault: {'; '.join(segv)}" if segv else "")


def main() -> int:
    work = harness.fresh_dir(Path(sys.argv[1]))
    harness.set_subreaper()
    jrp.cuda = jrp.Cuda()
    verdicts = []
    for name in sys.argv[2:] or DEFAULT:
        verdicts.append(run_case(name, work))
        say(verdicts[-1])                      # as it comes, in case the phase's timeout cuts the rest
    print("\n".join(["=== verdicts", *verdicts]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
