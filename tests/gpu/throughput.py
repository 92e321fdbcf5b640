"""What periodic checkpoints cost a running training job (root; driven by tests/gpu/throughput.sh).
The same deterministic loop (tests/gpu/workload_throughput.py, several GiB on the GPU) runs twice
as the job's unprivileged user:

  OFF  plain, no slurmckpt, for --seconds S (N steps);
  ON   through tests.support.fakestepd (the real root agent + the real wrapper) with --interval I, i.e.
       SLURMCKPT_INTERVAL=I: the coordinator captures every I s while the job runs on; the same N steps.

Reports steps/s of both (steps 1..N-1, from the job's own per-step wall-clock stamps), their ratio, the number of
captures (the wrapper's 'checkpoint epoch K committed (interval)' lines), each capture's stall (the longest gap
between consecutive step lines around it), image sizes and stage timings (rank.json of the kept epochs), and
checks that both runs' loss sequences are equal bit for bit and that the magic value survived.

    python3 tests/gpu/throughput.py --user U --job J --work DIR [--cpu] [--seconds S --interval I ...]

Exit 0 only if every check passed. Everything it produced is left in --work (off.out, on.out/err, agent.log,
rank.json files, summary.json).
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
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step (\d+) loss (\S+) t (\S+)$", re.M)
COMMIT = re.compile(r"checkpoint epoch (\d+) committed \(([\w-]+)\): (\d+) rank\(s\), ([\d.]+) MiB, "
                    r"frozen->committed ([\d.]+)s(?:, consistent cut after ([\d.]+)s in (\d+) round)?")
BAD = re.compile(r"ABORTED|crashed|fatal|Traceback|FAILED")
RESULTS: list[tuple[bool, str]] = []


def say(*parts: object) -> None:
    print(*parts, flush=True)


def check(ok: bool, what: str, detail: str = "") -> bool:
    RESULTS.append((bool(ok), what))
    say(f"{'PASS' if ok else 'FAIL'}: {what}{(' -- ' + detail) if detail else ''}")
    return bool(ok)


def text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def steps(path: Path) -> list[tuple[int, str, float]]:
    return [(int(s), loss, float(t)) for s, loss, t in STEP.findall(text(path))]


def workload(a, extra: list[str]) -> list[str]:
    cmd = [sys.executable, str(REPO / "tests" / "gpu" / "workload_throughput.py"), "--magic-mib", str(a.magic_mib),
           "--hidden", str(a.hidden), "--batch", str(a.batch), *extra]
    return cmd + (["--cpu"] if a.cpu else [])


def as_user(pw):
    def drop() -> None:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    return drop


def gpu_memory() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=20)
    return r.stdout.strip() or r.stderr.strip()


def rate(rows: list[tuple[int, str, float]]) -> tuple[float, float]:
    """(steps/s over steps 1..N-1, span s): step 0 (warm-up) is left out on both sides."""
    if len(rows) < 3:
        return 0.0, 0.0
    span = rows[-1][2] - rows[0][2]
    return (len(rows) - 1) / span, span


def gaps(rows: list[tuple[int, str, float]]) -> list[tuple[float, float, int]]:
    """(gap s, start time, step after the gap) between consecutive step lines."""
    return [(rows[i][2] - rows[i - 1][2], rows[i - 1][2], rows[i][0]) for i in range(1, len(rows))]


def run_off(a, pw, env) -> tuple[int, float]:
    say(f"OFF: plain run as {a.user} (no slurmckpt), --seconds {a.seconds}")
    cmd = workload(a, ["--seconds", str(a.seconds)])
    say("  $", " ".join(cmd))
    t0 = time.monotonic()
    with open(a.work / "off.out", "wb") as fo:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=subprocess.STDOUT, cwd=a.work,
                             env=env, preexec_fn=as_user(pw))
        sampled = False
        deadline = t0 + a.seconds + 150
        while p.poll() is None and time.monotonic() < deadline:
            if not sampled and len(steps(a.work / "off.out")) > 20:
                say(f"  GPU memory in use during OFF (nvidia-smi): {gpu_memory()}")
                sampled = True
            time.sleep(0.5)
        if p.poll() is None:
            say("  OFF run did not finish in time: killed")
            p.kill()
        rc = p.wait()
    return rc, time.monotonic() - t0


def run_on(a, n: int, env) -> tuple[int | None, float, list[tuple[float, str]]]:
    say(f"ON: fakestepd --interval {a.interval} (agent + wrapper), --steps {n}")
    cmd = [sys.executable, "-m", "tests.support.fakestepd", "--user", a.user, "--job", str(a.job), "--interval",
           str(a.interval), "--", *workload(a, ["--steps", str(n)])]
    say("  $", " ".join(cmd))
    out, err = a.work / "on.out", a.work / "on.err"
    seen: list[tuple[float, str]] = []        # (time.time() the driver saw it, line) of every wrapper line
    t0 = time.monotonic()
    with open(out, "wb") as fo, open(err, "wb") as fe:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, cwd=a.work, env=env)
    sampled, deadline = False, t0 + a.on_timeout
    while True:
        lines = text(err).splitlines()
        now = time.time()
        for line in lines[len(seen):]:
            seen.append((now, line))
            say(f"  [{now:.3f}] wrapper | {line}")
        if p.poll() is not None:
            break
        if not sampled and seen and any("committed" in s for _, s in seen):
            say(f"  GPU memory in use during ON (nvidia-smi, after the first capture): {gpu_memory()}")
            sampled = True
        if time.monotonic() > deadline:
            say(f"  ON run not done within {a.on_timeout}s: killing the wrapper and the job's processes")
            p.kill()
            p.wait()
            kill_cgroup(a)
            break
        time.sleep(0.05)
    now = time.time()
    for line in text(err).splitlines()[len(seen):]:
        seen.append((now, line))
        say(f"  [{now:.3f}] wrapper | {line}")
    return p.returncode, time.monotonic() - t0, seen


def kill_cgroup(a) -> None:
    for root in (Path("/sys/fs/cgroup/freezer/slurmckpt"), Path("/sys/fs/cgroup/slurmckpt")):
        for pid in text(root / f"{a.job}.batch.0.0" / "cgroup.procs").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--user", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="torch-free stand-in workload (rehearsal)")
    ap.add_argument("--gpus", default="0", help="CUDA_VISIBLE_DEVICES of the job (set: host PID namespace)")
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the OFF run's training loop")
    ap.add_argument("--interval", type=int, default=30, help="SLURMCKPT_INTERVAL of the ON run")
    ap.add_argument("--magic-mib", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--on-timeout", type=float, default=0, help="kill the ON run after this (0: 1.6*S + 60)")
    ap.add_argument("--images", default="/var/lib/slurmckpt/images", help="storage_root (<root>/<cluster>/<job>)")
    ap.add_argument("--logs", default="/var/log/slurmckpt")
    a = ap.parse_args()
    a.on_timeout = a.on_timeout or 1.6 * a.seconds + 60
    pw = pwd.getpwnam(a.user)
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER, like slurmstepd
    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    os.chown(a.work, pw.pw_uid, pw.pw_gid)
    for old in Path(a.images).glob(f"*/{a.job}"):
        shutil.rmtree(old, ignore_errors=True)
    Path(a.logs, f"agent-{a.job}.batch.0.log").unlink(missing_ok=True)
    env = dict(os.environ)
    env.update({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "CUDA_VISIBLE_DEVICES": a.gpus, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
    summary: dict = {"job": a.job, "user": a.user, "cpu": a.cpu, "seconds": a.seconds, "interval": a.interval,
                     "magic_mib": a.magic_mib, "hidden": a.hidden, "batch": a.batch}

    # ---- OFF ------------------------------------------------------------------------------------------
    rc, wall = run_off(a, pw, dict(env, HOME=pw.pw_dir, USER=a.user))
    off = steps(a.work / "off.out")
    off_text = text(a.work / "off.out")
    say("  " + "\n  ".join(line for line in off_text.splitlines() if not line.startswith("step ")))
    r_off, span_off = rate(off)
    summary["off"] = {"rc": rc, "wall_s": round(wall, 2), "steps": len(off), "span_s": round(span_off, 3),
                      "steps_per_s": round(r_off, 3)}
    say(f"OFF: rc={rc}, {len(off)} steps, steps 1..{len(off) - 1} in {span_off:.2f}s = {r_off:.3f} steps/s "
        f"(process wall {wall:.1f}s)")
    off_ok = rc == 0 and len(off) > 2 and "MAGIC OK" in off_text
    if not check(off_ok, "OFF run complete", "" if off_ok else off_text[-1500:]):
        return finish(a, summary)
    n = len(off)

    # ---- ON -------------------------------------------------------------------------------------------
    rc_on, wall_on, seen = run_on(a, n, env)
    on = steps(a.work / "on.out")
    on_text = text(a.work / "on.out")
    r_on, span_on = rate(on)
    summary["on"] = {"rc": rc_on, "wall_s": round(wall_on, 2), "steps": len(on), "span_s": round(span_on, 3),
                     "steps_per_s": round(r_on, 3)}
    say(f"ON: wrapper rc={rc_on}, {len(on)} steps, steps 1..{len(on) - 1} in {span_on:.2f}s = {r_on:.3f} steps/s "
        f"(fakestepd wall {wall_on:.1f}s)")
    check(rc_on == 0 and len(on) == n and "MAGIC OK" in on_text and "DONE" in on_text, "ON run complete",
          f"rc={rc_on}, {len(on)}/{n} steps, " + " ".join(l for l in on_text.splitlines()[-3:]))
    err_text = "\n".join(line for _, line in seen)
    check(not BAD.search(err_text), "no aborted/crashed capture in the wrapper's output")

    # ---- captures and their stalls --------------------------------------------------------------------
    caps = []
    for t_seen, line in seen:
        m = COMMIT.search(line)
        if m:
            caps.append({"epoch": int(m.group(1)), "reason": m.group(2), "mib": float(m.group(4)),
                         "frozen_to_committed_s": float(m.group(5)),
                         "cut_s": float(m.group(6)) if m.group(6) else None,
                         "lock_rounds": int(m.group(7)) if m.group(7) else None, "line_seen_at": t_seen})
    interval_caps = [c for c in caps if c["reason"] == "interval"]
    check(len(interval_caps) >= 1, "periodic (interval) captures committed while the job ran",
          f"{len(interval_caps)} capture(s)")
    g = gaps(on)
    g_off = gaps(off)
    med_off = statistics.median(x for x, _, _ in g_off) if g_off else 0.0
    med_on = statistics.median(x for x, _, _ in g) if g else 0.0
    t_first = on[0][2] if on else 0.0
    prev_seen = 0.0
    for c in caps:
        # the capture began about frozen->committed before its line was seen (plus the driver's 50 ms poll); the
        # job is thawed around the commit. A gap counts for this capture if it overlaps that window and starts
        # after the previous capture's line.
        seen_at = c["line_seen_at"]
        lo, hi = seen_at - c["frozen_to_committed_s"] - 2, seen_at + 2
        around = [x for x in g if x[1] + x[0] >= lo and x[1] <= hi and x[1] >= prev_seen]
        prev_seen = seen_at
        best = max(around, default=(0.0, 0.0, -1))
        c["stall_s"] = round(best[0], 3)
        c["stall_before_step"] = best[2]
        c["stall_starts_at_job_s"] = round(best[1] - t_first, 2) if best[2] >= 0 else None
        c["excess_s"] = round(best[0] - med_off, 3)
        del c["line_seen_at"]
    summary["captures"] = caps
    summary["median_step_s"] = {"off": round(med_off, 5), "on": round(med_on, 5)}
    summary["longest_gap_off_s"] = round(max((x for x, _, _ in g_off), default=0.0), 3)
    stalls = sum(c["stall_s"] for c in interval_caps)
    summary["sum_capture_stalls_s"] = round(stalls, 3)
    summary["extra_span_on_minus_off_s"] = round(span_on - span_off, 3)
    if r_off and r_on:
        summary["ratio_on_over_off"] = round(r_on / r_off, 4)
        between = (len(on) - 1 - len(interval_caps)) / max(span_on - stalls, 1e-9)
        summary["on_steps_per_s_outside_captures"] = round(between, 3)

    # ---- results --------------------------------------------------------------------------------------
    want = [(s, loss) for s, loss, _ in off]
    got = [(s, loss) for s, loss, _ in on]
    diff = [(s, x, y) for (s, x), (_, y) in zip(got, want) if x != y]
    check(got == want, "loss sequences of OFF and ON equal bit for bit",
          f"{len(got)} vs {len(want)} steps; first differences {diff[:3]}" if got != want else f"{len(got)} steps")
    check([s for s, _ in got] == list(range(n)), "every step exactly once, in order, in the ON job's output")
    summary["losses_first_last"] = [want[0], want[-1]] if want else None
    summary["magic"] = {"off": (re.search(r"^MAGIC .*$", off_text, re.M) or [None])[0],
                        "on": (re.search(r"^MAGIC .*$", on_text, re.M) or [None])[0]}
    return finish(a, summary)


def finish(a, summary: dict) -> int:
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
        say(f"{name} (kept): {e['bytes'] / 2**20:.1f} MiB, {e['processes']} processes, "
            f"timings {json.dumps(e['timings'])}")
    agent_log = Path(a.logs) / f"agent-{a.job}.batch.0.log"
    if agent_log.exists():
        shutil.copy(agent_log, a.work / "agent.log")
        for line in agent_log.read_text(errors="replace").splitlines():
            if re.search(r"committed epoch|launched|consistent cut|ERROR|WARNING|crashed|failed|abort", line):
                say("  agent |", line[:300])
    summary["checks"] = [{"ok": ok, "what": what} for ok, what in RESULTS]
    (a.work / "summary.json").write_text(json.dumps(summary, indent=1))
    say("")
    say("==== RESULTS")
    off, on = summary.get("off", {}), summary.get("on", {})
    say(f"OFF : {off.get('steps')} steps, {off.get('steps_per_s')} steps/s over {off.get('span_s')} s "
        f"(median step {summary.get('median_step_s', {}).get('off')} s, longest gap "
        f"{summary.get('longest_gap_off_s')} s)")
    say(f"ON  : {on.get('steps')} steps, {on.get('steps_per_s')} steps/s over {on.get('span_s')} s "
        f"(interval {a.interval} s; {on.get('steps') and summary.get('on_steps_per_s_outside_captures')} steps/s "
        "outside the capture stalls)")
    say(f"ratio ON/OFF: {summary.get('ratio_on_over_off')}; ON span - OFF span = "
        f"{summary.get('extra_span_on_minus_off_s')} s; sum of capture stalls = {summary.get('sum_capture_stalls_s')} s")
    for c in summary.get("captures", []):
        say(f"  capture epoch {c['epoch']} ({c['reason']}) at job t={c['stall_starts_at_job_s']} s: {c['mib']} MiB, "
            f"frozen->committed {c['frozen_to_committed_s']} s, cut {c['cut_s']} s in {c['lock_rounds']} round(s), "
            f"stall {c['stall_s']} s before step {c['stall_before_step']} (+{c['excess_s']} s over a median step)")
    say("summary:", json.dumps({k: v for k, v in summary.items() if k not in ("rank_json", "checks", "captures")}))
    passed = bool(RESULTS) and all(ok for ok, _ in RESULTS)
    if not passed and agent_log.exists():
        say("agent log (last 60 lines):")
        for line in agent_log.read_text(errors="replace").splitlines()[-60:]:
            say("  agent |", line[:600])
    say(f"RESULT: {'PASS' if passed else 'FAIL'} ({sum(ok for ok, _ in RESULTS)}/{len(RESULTS)} checks)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
