"""--checkpoint-interval=auto against fixed intervals: the overhead each yields for the same job and the same
interruptions (a simulation driven by measured stalls, restore times and interruption rates; no Slurm, no root).

A real job cannot show this on a 2-core test machine in minutes: the interval matters over hours of work and
tens of interruptions. So the job is simulated, and everything that decides the outcome is measured or is the
product's own code:

  stall C      each capture's stall is drawn from stalls measured by slurmckpt (freeze .. all ranks dumped):
               the scenarios below cite their results files; `--stalls` takes others (e.g. the `stalls` that
               `slurmckpt status --json JOB` shows for a real job under auto);
  restore R    the measured restore of the same job (paid after every interruption);
  M            interruptions are a Poisson process with mean time between them M (the job's node time);
               auto learns M from a partition history drawn from the same process (the root agent's
               `interruptions.tally`/`answer` over `--history-node-days` of node time, weighed with the site's
               interruption_mtbi 1d as in the product) -- it is told the site's value until its first commit;
  auto         slurmckpt's own chooser (coordinator/interval.AutoInterval: Daly's interval from the median of
               the last 5 stalls, auto_first_interval 10m, bounds 10s..1d), a new coordinator after every
               requeue started from the stalls the job's store recorded (summary.recorded_stalls).

The job: `--work` hours of computation on one node. Periodic captures every interval of running time after
the previous capture ended (coordinator/interval.py IntervalClock); an interruption (during work, a capture or a restore)
loses the work since the last committed capture and costs a restore. Overhead = (stall + lost work +
restores) / work. The queue wait after a requeue is the same for every interval and left out. The persist
after the thaw (compress, copy) runs beside the job and is not counted. Runs are paired: every interval of
one seed sees the same interruption times (in running time) and the same stall draws. `oracle` is Daly's
interval for the true mean stall and M, fixed from the start: what auto aims at.

    python benchmarks/interval_auto.py [--seeds 40] [--work 48] [--mtbi 1h,6h,24h] [--out FILE]
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src")]

from slurmckpt.coordinator.interval import AutoInterval, AutoSettings, daly  # noqa: E402
from slurmckpt.duration import format_duration, parse_duration  # noqa: E402
from slurmckpt.agent.interruptions import answer, tally  # noqa: E402

# Measured stalls (s) and restore (s) per scenario, with where they were measured.
SCENARIOS = {
    "cpu-1gib": ([0.48, 0.58, 0.61], 3.21, "CPU process, 1 GiB mixed data, local store: stall freeze..thaw and "
                 "restore, N=5 min/median/max (benchmarks/results/store-cpu-summary.txt)"),
    "cpu-8gib-gluster": ([4.16, 4.55, 5.14], 19.25, "CPU process, 8 GiB mixed, store on GlusterFS: stall and "
                         "restore, N=3 (benchmarks/results/store-cpu-8gib-glusterfs-2026-12-05.txt)"),
    "gpu-32gib": ([25.01, 23.87, 25.55, 25.547], 16.6, "H200, 32 GiB on the GPU: freeze (GPU checkpoint + criu "
                  "dump) of 4 cycles, restore-to-running median (benchmarks/results/"
                  "gpu-h200-thp-throughput-32gib-2026-12-05.txt)"),
}
FIXED = (30, 120, 600, 3600)
SITE = AutoSettings(min_s=10, max_s=86400, first_s=600, mtbi_s=86400.0, min_from="", max_from="")


@dataclass
class Outcome:
    overhead: float            # (stall + lost + restore) / work
    stall: float
    lost: float
    restore: float
    captures: int
    interruptions: int
    intervals: list[int]       # what auto chose at each capture (fixed: the interval)


class Job:
    """One simulated job under one interval policy (`fixed` seconds, or None for auto)."""

    def __init__(self, work_s: float, trace: list[float], stalls: list[float], restore_s: float,
                 told: dict | None, fixed: int | None) -> None:
        self.work, self.trace, self.stalls, self.restore_s = work_s, trace, stalls, restore_s
        self.told, self.fixed = told, fixed
        self.recorded: list[float] = []          # the store's interval record: survives requeues

    def run(self) -> Outcome:
        t = committed = progress = 0.0
        k = j = 0
        stall = lost = restore = 0.0
        captures = interruptions = 0
        intervals: list[int] = []
        auto = self._coordinator(first_run=True)
        while True:
            interval = self.fixed if self.fixed else auto.current.interval_s
            seg = min(float(interval), self.work - progress)
            if self.trace[k] < t + seg:                       # interrupted while working
                progress += self.trace[k] - t
                t = self.trace[k]
            else:
                t += seg
                progress += seg
                if progress >= self.work:
                    return Outcome((stall + lost + restore) / self.work, stall, lost, restore, captures,
                                   interruptions, intervals)
                c = self.stalls[j % len(self.stalls)]
                j += 1
                if self.trace[k] >= t + c:                    # the capture commits
                    t += c
                    stall += c
                    committed = progress
                    captures += 1
                    intervals.append(int(interval))
                    if not self.fixed:
                        auto.observe({"status": "committed", "final": False, "stall_s": c})
                        self.recorded = list(auto.current.stalls)
                        if self.told:               # the agent's answer comes after the first commit
                            auto.heard(self.told)
                    continue
                stall += self.trace[k] - t                    # interrupted while frozen: the capture is lost
                t = self.trace[k]
            # interrupted: the work since the last commit is lost; restore (interruptible too), run again
            lost += progress - committed
            progress = committed
            interruptions += 1
            k += 1
            while self.trace[k] < t + self.restore_s:
                restore += self.trace[k] - t
                t = self.trace[k]
                interruptions += 1
                k += 1
            t += self.restore_s
            restore += self.restore_s
            auto = self._coordinator(first_run=False)

    def _coordinator(self, first_run: bool) -> AutoInterval:
        """A new coordinator: the plan's settings with the stalls the store recorded; on later runs the node's
        cache answers at once."""
        settings = AutoSettings(**{**SITE.as_dict(), "stalls": tuple(self.recorded[-5:])})
        auto = AutoInterval(settings)
        if not first_run and self.told:
            auto.heard(self.told)
        return auto


def trace(rng: random.Random, mtbi: float, horizon: float) -> list[float]:
    """Interruption times (running time) of a Poisson process, far enough for any policy."""
    out, t = [], 0.0
    while t < horizon:
        t += rng.expovariate(1 / mtbi)
        out.append(t)
    return out + [float("inf")]


def told_by_accounting(rng: random.Random, mtbi: float, node_days: float) -> dict:
    """The agent's answer for a partition whose history is `node_days` of node time under the same process
    (its interruptions counted, its node time summed as sacct's runs give them), tallied and weighed as in
    the product."""
    node_s = node_days * 86400
    count = 0
    t = rng.expovariate(1 / mtbi)
    while t < node_s:
        count += 1
        t += rng.expovariate(1 / mtbi)
    runs = [("NODE_FAIL", 0, 1)] * count + [("COMPLETED", int(node_s), 1)]
    history = tally("p", runs, ("NODE_FAIL",), 7 * 86400, time.time())
    return answer(history, False, SITE.mtbi_s, 1, 7 * 86400)


def spread(values: list[float]) -> str:
    return f"{min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40, help="paired runs per scenario and M")
    ap.add_argument("--work", type=float, default=48.0, help="hours of computation of the job")
    ap.add_argument("--mtbi", default="1h,6h,24h", help="true mean times between interruptions (durations)")
    ap.add_argument("--history-node-days", type=float, default=112.0,
                    help="node time of the partition's accounting history auto reads (16 nodes x 7 days)")
    ap.add_argument("--scenario", action="append", help="only these scenarios (default: all)")
    ap.add_argument("--stalls", help="a scenario of your own: measured stalls, comma-separated seconds")
    ap.add_argument("--restore", type=float, default=1.0, help="its restore time (s), with --stalls")
    ap.add_argument("--label", default="measured", help="its name, with --stalls")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args()

    scenarios = {k: v for k, v in SCENARIOS.items() if not args.scenario or k in args.scenario}
    if args.stalls:
        scenarios[args.label] = ([float(s) for s in args.stalls.split(",")], args.restore, "given with --stalls")
    work = args.work * 3600
    mtbis = [parse_duration(m) for m in args.mtbi.split(",")]
    lines = [f"--checkpoint-interval=auto vs fixed intervals: simulated job of {args.work:g} h of work on one node, "
             f"{args.seeds} paired runs per row (same interruptions, same stall draws for every interval)",
             f"host: {platform.node()}, python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M:%S')}; "
             f"auto: first 10m, bounds 10s..1d, site interruption_mtbi 1d, accounting history "
             f"{args.history_node_days:g} node-days",
             "command: python benchmarks/interval_auto.py " + " ".join(sys.argv[1:]), ""]
    t0 = time.monotonic()
    for name, (stalls, restore_s, source) in scenarios.items():
        lines += [f"== {name}: stalls {stalls} s, restore {restore_s} s -- {source}"]
        for mtbi in mtbis:
            oracle = max(10, round(daly(statistics.mean(stalls), mtbi)))
            policies = {**{format_duration(f): f for f in FIXED}, f"oracle {format_duration(oracle)}": oracle,
                        "auto": None}
            got: dict[str, list[Outcome]] = {p: [] for p in policies}
            for seed in range(args.seeds):
                rng = random.Random(f"{name}-{mtbi}-{seed}")
                times = trace(rng, mtbi, work * 20 + 100 * mtbi)
                draws = [rng.choice(stalls) for _ in range(200_000)]
                told = told_by_accounting(rng, mtbi, args.history_node_days)
                for label, fixed in policies.items():
                    got[label].append(Job(work, times, draws, restore_s, told, fixed).run())
            best_fixed = min((p for p in policies if p != "auto" and not p.startswith("oracle")),
                             key=lambda p: statistics.median(o.overhead for o in got[p]))
            lines += [f"   M = {format_duration(mtbi)} (Daly for the mean stall: {oracle} s)",
                      f"   {'interval':<14} {'overhead %  min  median     max':>31}   {'stall %':>7} {'lost %':>7} "
                      f"{'restore %':>9} {'captures':>8} {'interrupts':>10}  auto chose (median of runs' medians)"]
            for label in policies:
                runs = got[label]
                med = lambda f: statistics.median(f(o) for o in runs)  # noqa: E731
                chose = f"{statistics.median(statistics.median(o.intervals) for o in runs if o.intervals):.0f} s" \
                    if label == "auto" and any(o.intervals for o in runs) else ""
                lines.append(f"   {label:<14} {spread([o.overhead * 100 for o in runs]):>31}   "
                             f"{med(lambda o: o.stall / work * 100):7.2f} {med(lambda o: o.lost / work * 100):7.2f} "
                             f"{med(lambda o: o.restore / work * 100):9.2f} {med(lambda o: o.captures):8.0f} "
                             f"{med(lambda o: o.interruptions):10.0f}  {chose}")
            ratio = [a.overhead / b.overhead for a, b in zip(got["auto"], got[best_fixed]) if b.overhead > 0]
            vs = {p: sum(a.overhead <= b.overhead for a, b in zip(got["auto"], got[p]))
                  for p in policies if p != "auto"}
            lines += [f"   auto / best fixed ({best_fixed}) per pair: {spread(ratio)}; auto at or below the fixed "
                      f"interval in " + ", ".join(f"{p} {n}/{args.seeds}" for p, n in vs.items()), ""]
    lines.append(f"({time.monotonic() - t0:.0f} s)")
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
