"""Throughput of one training loop with and without periodic checkpoints, from two job outputs
(tests/gpu/real_slurm.sh RS_THROUGHPUT=...: the same tests/gpu/workload_throughput.py as a Slurm job without
--checkpoint-interval, then with it).

    python3 tests/gpu/throughput_report.py OFF.out ON.out INTERVAL_S

Prints steps/s of both (steps 1..N-1, from the job's own per-step wall-clock stamps), the ratio, each capture
(its commit line and its stall: the longest gap between step lines around it), the ratio extrapolated to
longer intervals (each interval of training pays one mean stall), and checks: same steps, equal losses bit for
bit, every step exactly once, magic value intact. Exit 0 only if every check passed.
"""
from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"^step (\d+) loss (\S+) t ([\d.]+)$", re.M)
COMMIT = re.compile(r"checkpoint epoch (\d+) committed \(interval\): .*?([\d.]+) MiB, frozen->committed ([\d.]+)s")


def rows(text: str) -> list[tuple[int, str, float]]:
    return [(int(s), loss, float(t)) for s, loss, t in STEP.findall(text)]


def rate(r: list[tuple[int, str, float]]) -> float:
    return (len(r) - 1) / (r[-1][2] - r[0][2]) if len(r) > 2 else 0.0


def main() -> int:
    off_text, on_text = Path(sys.argv[1]).read_text(errors="replace"), Path(sys.argv[2]).read_text(errors="replace")
    interval = float(sys.argv[3])
    off, on = rows(off_text), rows(on_text)
    if len(off) < 3 or len(on) < 3:
        print(f"FAIL: too few step lines (off {len(off)}, on {len(on)})")
        return 1
    r_off, r_on = rate(off), rate(on)
    median = statistics.median(b[2] - a[2] for a, b in zip(off, off[1:]))
    gaps = sorted(((b[2] - a[2], b[0]) for a, b in zip(on, on[1:]) if b[2] - a[2] > 10 * median), key=lambda g: g[1])
    commits = COMMIT.findall(on_text)
    print(f"OFF: {len(off)} steps, {r_off:.3f} steps/s (median step {median:.5f} s)")
    print(f"ON (--checkpoint-interval={interval:.0f}s): {len(on)} steps, {r_on:.3f} steps/s")
    print(f"ratio ON/OFF {r_on / r_off:.4f} over {on[-1][2] - on[0][2]:.1f} s with {len(commits)} capture(s)")
    for epoch, mib, committed in commits:
        print(f"  epoch {epoch}: {mib} MiB, frozen->committed {committed} s")
    for gap, step in gaps:
        print(f"  stall {gap:.3f} s before step {step}")
    if gaps:
        stall = statistics.mean(g for g, _ in gaps)
        between = (on[-1][2] - on[0][2] - sum(g for g, _ in gaps)) / max(1, len(gaps))
        print(f"mean stall {stall:.3f} s (min {min(g for g, _ in gaps):.3f}, max {max(g for g, _ in gaps):.3f}); "
              f"training between captures {between:.1f} s")
        for every in (interval, 600.0, 1800.0, 3600.0):
            print(f"  extrapolated ON/OFF with a capture every {every:.0f} s of training: {every / (every + stall):.4f}")
    checks = {
        "same number of steps": len(on) == len(off),
        "losses equal bit for bit": [(s, l) for s, l, _ in on] == [(s, l) for s, l, _ in off],
        "every step exactly once": [s for s, _, _ in on] == list(range(len(on))),
        "magic value intact (both)": "MAGIC OK" in off_text and "MAGIC OK" in on_text,
        "at least one capture": bool(commits),
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
