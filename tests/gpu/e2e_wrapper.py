"""Through the wrapper (root; driven by tests/gpu/e2e_wrapper.sh): a deterministic training loop
started through tests.support.fakestepd (the real root agent + the real wrapper, as the SPANK shim starts them,
for an unprivileged user) is captured mid-run by our pipeline -- one periodic capture (SIGRTMIN+4 to the
wrapper; the job runs on), then a final one (SIGTERM; the tree is killed after the commit) -- and restored by a
second fakestepd run with --restart 1. Its loss sequence must equal an uninterrupted run's bit for bit, every
step must appear exactly once in the job's output file, and the magic value in (device) memory must survive.

    python3 tests/gpu/e2e_wrapper.py --user U --job J --work DIR [--cpu] [--steps N --sleep S ...]

Prints PASS/FAIL lines and the timings (rank.json "timings", the wrapper's stderr lines); exit 0 only if every
check passed. Everything it produced is left in --work (job.out/err of both runs, agent log, rank.json files).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)
STEP = re.compile(rb"^step (\d+) ", re.M)
CHECKPOINT_SIGNAL = signal.SIGRTMIN + 4
RESULTS: list[tuple[bool, str]] = []


def say(*parts: object) -> None:
    print(*parts, flush=True)


def check(ok: bool, what: str, detail: str = "") -> bool:
    RESULTS.append((bool(ok), what))
    say(f"{'PASS' if ok else 'FAIL'}: {what}{(' -- ' + detail) if detail else ''}")
    return bool(ok)


def losses(text: str) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in LOSS.findall(text)]


class Tail:
    """Follows a file (the job's output), noting when each step line first appeared."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen, self.stamps = path, 0, {}

    def poll(self) -> None:
        try:
            data = self.path.read_bytes()
        except OSError:
            return
        now = time.monotonic()
        if len(data) < self.seen:     # truncated (restore rewrote it): start over, keep old stamps
            self.seen = 0
        for m in STEP.finditer(data, self.seen):
            self.stamps.setdefault(int(m.group(1)), now)
        self.seen = data.rfind(b"\n") + 1

    def last_step(self) -> int:
        return max(self.stamps, default=-1)

    def longest_stall(self, lo: int, hi: int) -> tuple[float, int]:
        """Largest gap between consecutive steps lo..hi (seconds, step after the gap)."""
        best = (0.0, -1)
        for s in range(lo + 1, hi + 1):
            if s in self.stamps and s - 1 in self.stamps:
                best = max(best, (self.stamps[s] - self.stamps[s - 1], s))
        return best


def wait_until(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, tails=()) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in tails:
            t.poll()
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            for t in tails:
                t.poll()
            if cond():
                return True
            say(f"  ({what}: process exited with {proc.returncode} first)")
            return False
        time.sleep(0.005)
    say(f"  ({what}: not within {timeout}s)")
    return False


def fakestepd(a, extra: list[str], out: Path, err: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.support.fakestepd", "--user", a.user, "--job", str(a.job), *extra,
           "--", *workload(a, a.sleep)]
    say("  $", " ".join(cmd))
    with open(out, "wb") as fo, open(err, "wb") as fe:     # truncated, like Slurm's output file on a requeue
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, cwd=a.work, env=env)


def workload(a, sleep: float) -> list[str]:
    script = REPO / "tests" / "gpu" / ("workload_cpu.py" if a.cpu else "workload_train.py")
    return [sys.executable, str(script), "--steps", str(a.steps), "--sleep", str(sleep),
            "--magic-mib", str(a.magic_mib)]


def job_env(a) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "CUDA_VISIBLE_DEVICES": a.gpus,
                "PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
    return env


def as_user(pw):
    def drop() -> None:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    return drop


def text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--user", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="torch-free stand-in workload (rehearsal)")
    ap.add_argument("--gpus", default="0", help="CUDA_VISIBLE_DEVICES of the job (set: host PID namespace)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--magic-mib", type=int, default=256)
    ap.add_argument("--periodic-at", type=int, default=40)
    ap.add_argument("--final-after", type=int, default=60, help="steps after the periodic commit")
    ap.add_argument("--images", default="/var/lib/slurmckpt/images", help="storage_root (<root>/<cluster>/<job>)")
    ap.add_argument("--logs", default="/var/log/slurmckpt")
    a = ap.parse_args()
    pw = pwd.getpwnam(a.user)
    # like slurmstepd: processes the wrapper leaves behind re-parent to us, and we reap them
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    os.chown(a.work, pw.pw_uid, pw.pw_gid)
    for old in Path(a.images).glob(f"*/{a.job}"):
        shutil.rmtree(old, ignore_errors=True)
    Path(a.logs, f"agent-{a.job}.batch.0.log").unlink(missing_ok=True)
    env = job_env(a)
    out, err = a.work / "job.out", a.work / "job.err"
    summary: dict = {"job": a.job, "user": a.user, "steps": a.steps, "sleep": a.sleep, "cpu": a.cpu}

    # ---- 1. the uninterrupted reference run (the job's user, same environment, no wrapper) ----------------
    t0 = time.monotonic()
    with open(a.work / "ref.out", "wb") as fo:
        rc = subprocess.run(workload(a, 0.0), stdin=subprocess.DEVNULL, stdout=fo, stderr=subprocess.STDOUT,
                            cwd=a.work, env=dict(env, HOME=pw.pw_dir, USER=a.user), preexec_fn=as_user(pw),
                            timeout=300).returncode
    ref = losses(text(a.work / "ref.out"))
    say(f"reference run (as {a.user}): rc={rc}, {len(ref)} steps in {time.monotonic() - t0:.1f}s, "
        f"last loss {ref[-1][1] if ref else None}")
    ref_ok = rc == 0 and len(ref) == a.steps
    if not check(ref_ok, "reference run complete", "" if ref_ok else text(a.work / "ref.out")[-1500:]):
        return finish(a, summary)

    # ---- 2. first run through fakestepd: periodic capture, then SIGTERM (final capture) -------------------
    say("run 1: fakestepd (agent + wrapper), periodic capture, then SIGTERM")
    t_start = time.monotonic()
    p1 = fakestepd(a, [], out, err, env)
    tail = Tail(out)
    if not wait_until(lambda: tail.last_step() >= a.periodic_at, 120, f"step {a.periodic_at}", p1, [tail]):
        return finish(a, summary, p1)
    summary["run1_start_to_step"] = round(tail.stamps[a.periodic_at] - t_start, 2)
    step_at_signal = tail.last_step()
    t_sig = time.monotonic()
    os.kill(p1.pid, CHECKPOINT_SIGNAL)
    say(f"  SIGRTMIN+4 -> wrapper pid {p1.pid} at step {step_at_signal}")
    committed = re.compile(r"committed \((\w[\w-]*)\).*frozen->committed ([\d.]+)s")
    bad = re.compile(r"ABORTED|crashed|fatal|Traceback")
    ok = wait_until(lambda: "committed (manual)" in text(err) or bad.search(text(err)), 120,
                    "periodic commit", p1, [tail])
    step_at_commit = tail.last_step()
    if not check(ok and "committed (manual)" in text(err), "periodic capture committed", text(err)[-2000:]):
        return finish(a, summary, p1)
    summary["periodic_signal_to_commit_line_s"] = round(time.monotonic() - t_sig, 3)
    target = step_at_commit + a.final_after
    ran_on = wait_until(lambda: tail.last_step() >= target, 120, f"step {target}", p1, [tail])
    check(ran_on, "job ran on after the periodic capture",
          f"steps {step_at_signal} (signal) .. {step_at_commit} (commit line) .. {tail.last_step()}")
    stall, stall_step = tail.longest_stall(step_at_signal, tail.last_step())
    summary["periodic_output_stall_s"] = round(stall, 3)
    say(f"  longest output stall around the periodic capture: {stall:.3f}s (before step {stall_step})")
    if not ran_on:
        return finish(a, summary, p1)
    step_at_term = tail.last_step()
    t_term = time.monotonic()
    os.kill(p1.pid, signal.SIGTERM)
    say(f"  SIGTERM -> wrapper pid {p1.pid} at step {step_at_term}")
    try:
        rc1 = p1.wait(120)
    except subprocess.TimeoutExpired:
        say("  wrapper still running 120 s after SIGTERM")
        return finish(a, summary, p1)
    tail.poll()
    summary["sigterm_to_wrapper_exit_s"] = round(time.monotonic() - t_term, 3)
    shutil.copy(out, a.work / "run1.job.out")
    shutil.copy(err, a.work / "run1.job.err")
    err1 = text(err)
    say(f"  run 1 wrapper exit code {rc1}; its stderr:")
    for line in err1.splitlines():
        say("   |", line)
    finals = committed.findall(err1)
    check("committed (sigterm)" in err1, "final capture committed (SIGTERM)")
    out1 = losses(text(out))
    summary["run1_last_step"] = out1[-1][0] if out1 else None
    check(out1 and out1[-1][0] < a.steps - 1 and "DONE" not in text(out), "run 1 was killed mid-run",
          f"last step {summary['run1_last_step']} of {a.steps}")
    summary["leftovers_after_run1"] = kill_leftovers(a)
    summary["commits"] = [{"reason": r, "frozen_to_committed_s": float(s)} for r, s in finals]

    # ---- 3. second run through fakestepd with --restart 1: the wrapper restores the newest epoch ----------
    say("run 2: fakestepd --restart 1 (restore)")
    t_start = time.monotonic()
    p2 = fakestepd(a, ["--restart", "1"], out, err, env)
    tail2 = Tail(out)
    first_new = summary["run1_last_step"] + 1 if summary["run1_last_step"] is not None else 0
    wait_until(lambda: first_new in tail2.stamps, 120, f"step {first_new} after restore", p2, [tail2])
    if first_new in tail2.stamps:
        summary["run2_start_to_first_new_step_s"] = round(tail2.stamps[first_new] - t_start, 3)
    try:
        rc2 = p2.wait(300)
    except subprocess.TimeoutExpired:
        say("  restored job did not finish within 300 s")
        return finish(a, summary, p2)
    err2, out2_text = text(err), text(out)
    say(f"  run 2 wrapper exit code {rc2}; its stderr:")
    for line in err2.splitlines():
        say("   |", line)
    restored = re.search(r"restored from checkpoint epoch (\d+) in ([\d.]+)s", err2)
    summary["restored"] = {"epoch": int(restored.group(1)), "wrapper_s": float(restored.group(2))} if restored \
        else None

    # ---- 4. checks -----------------------------------------------------------------------------------
    got = losses(out2_text)
    check(rc2 == 0, "restored job exited 0", f"rc={rc2}")
    check(restored is not None and "from the beginning" not in err2 and "FAILED" not in err2,
          "run 2 restored the checkpoint (no fresh start)")
    check(out2_text.count("READY") == 1, "the job's output holds one start (READY) only",
          f"{out2_text.count('READY')} READY lines")
    check([s for s, _ in got] == list(range(a.steps)), "every step exactly once, in order, in the job's output",
          f"{len(got)} step lines")
    want = dict(ref)
    diff = [(s, x, want.get(s)) for s, x in got if x != want.get(s)]
    check(got == ref, "losses equal the uninterrupted run bit for bit",
          f"first differences {diff[:3]}" if diff else "")
    magic = re.search(r"^MAGIC (\w+) .*$", out2_text, re.M)
    check(magic is not None and magic.group(1) == "OK", "magic value in memory survived",
          magic.group(0) if magic else "no MAGIC line")
    check("DONE" in out2_text, "job ran to the end")
    summary["magic_line"] = magic.group(0) if magic else None
    summary["losses_0_100_last"] = [got[i] for i in (0, 100, -1) if len(got) > abs(i)]
    return finish(a, summary)


def kill_leftovers(a) -> list[str]:
    """What slurmstepd does when a step's task exits (proctrack/cgroup): SIGKILL every process left in the
    step. Here: the processes left in the task's freezer cgroup (pipeline.finish kills only the tree's root;
    in the host PID namespace -- GPU tasks -- the workload outlives it, keeps the old root's pid as its
    session id and so blocks criu restore of that pid: "Can't fork for <pid>: File exists")."""
    time.sleep(0.5)
    left = []
    for root in (Path("/sys/fs/cgroup/freezer/slurmckpt"), Path("/sys/fs/cgroup/slurmckpt")):
        procs = root / f"{a.job}.batch.0.0" / "cgroup.procs"
        for pid in (int(x) for x in text(procs).split()):
            cmd = text(Path(f"/proc/{pid}/cmdline")).replace("\0", " ").strip()
            left.append(f"{pid} {cmd[:120]}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for item in left:            # gone means reaped: a zombie still holds its pid and its session id
        pid = int(item.split()[0])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:          # not ours (re-parented elsewhere): wait for its reaper
                if not os.path.exists(f"/proc/{pid}"):
                    break
            time.sleep(0.02)
    roots = re.findall(r"launched .* as pid (\d+)", text(Path(a.logs) / f"agent-{a.job}.batch.0.log"))
    if roots:
        holders = [d for d in os.listdir("/proc") if d.isdigit()
                   and text(Path(f"/proc/{d}/stat")).rsplit(")", 1)[-1].split()[3:4] == [roots[-1]]]
        say(f"  processes still in the old root's session {roots[-1]}: {holders or 'none'}")
        for pid in holders:      # who they are: a holder keeps the root's pid busy for criu restore
            stat = text(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[-1].split()
            say(f"    {pid}: state {stat[0]} ppid {stat[1]} cgroup {text(Path(f'/proc/{pid}/cgroup')).strip()} "
                f"cmd {text(Path(f'/proc/{pid}/cmdline')).replace(chr(0), ' ')[:160]}")
    if left:
        say(f"NOTE: {len(left)} process(es) of the tree outlived the final capture; killed them as slurmstepd "
            f"would at the end of the step: {left}")
    else:
        say("  no process of the tree outlived the final capture")
    return left


def finish(a, summary: dict, proc: subprocess.Popen | None = None) -> int:
    if proc is not None and proc.poll() is None:
        say(f"  killing fakestepd {proc.pid} (wrapper) after a failure")
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    # timings: rank.json of every epoch, the agent log
    job_dir = next(iter(Path(a.images).glob(f"*/{a.job}")), Path(a.images) / "none")
    epochs = {}
    for rank_json in sorted(job_dir.glob("epoch-*/*/rank.json")):
        m = json.loads(rank_json.read_text())
        epochs[rank_json.parent.parent.name] = {
            "timings": m.get("timings"), "bytes": sum(f["size"] for f in m.get("files", {}).values()),
            "processes": m.get("processes"), "gpu": m.get("gpu")}
        shutil.copy(rank_json, a.work / f"{rank_json.parent.parent.name}.rank.json")
    manifest = job_dir / "manifest.json"
    if manifest.exists():
        summary["manifest_epochs"] = [(e["epoch"], e.get("reason")) for e in
                                      json.loads(manifest.read_text()).get("epochs", [])]
        shutil.copy(manifest, a.work / "manifest.json")
    summary["rank_json"] = epochs
    for name, e in epochs.items():
        say(f"{name}: {e['bytes'] / 2**20:.1f} MiB, {e['processes']} processes, timings {json.dumps(e['timings'])}")
    agent_log = Path(a.logs) / f"agent-{a.job}.batch.0.log"
    if agent_log.exists():
        shutil.copy(agent_log, a.work / "agent.log")
        for line in agent_log.read_text(errors="replace").splitlines():
            if re.search(r"restored epoch|committed epoch|launched|ERROR|WARNING|crashed|failed", line):
                say("  agent |", line[:400])
    summary["checks"] = [{"ok": ok, "what": what} for ok, what in RESULTS]
    (a.work / "summary.json").write_text(json.dumps(summary, indent=1))
    say("summary:", json.dumps({k: v for k, v in summary.items() if k not in ("rank_json", "checks")}))
    passed = bool(RESULTS) and all(ok for ok, _ in RESULTS)
    if not passed and agent_log.exists():
        say("agent log (last 80 lines):")
        for line in agent_log.read_text(errors="replace").splitlines()[-80:]:
            say("  agent |", line[:600])
    say(f"RESULT: {'PASS' if passed else 'FAIL'} ({sum(ok for ok, _ in RESULTS)}/{len(RESULTS)} checks)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
