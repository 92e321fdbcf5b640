"""--checkpoint-interval=auto: the job's coordinator chooses the interval (docs/operations.md, "Automatic
interval").

C, the cost of a capture, is the stall the job's tasks see: from PREPARE (trees start to freeze) until every
rank has dumped (the coordinator then sends RESUME and the trees thaw; the persist that follows runs beside
the job). The median of the last STALL_SAMPLES periodic captures, so that one slow capture (a busy store, a
node under load) does not swing the interval. M, the mean time between interruptions of the job, comes from
the root agent (interruptions.py: the partition's history in accounting, weighed against the site's value).

Daly's (2006) higher-order interval, T = sqrt(2CM) (1 + sqrt(C/2M)/3 + C/18M) - C for C < 2M, else M;
Young's (1974) first-order sqrt(2CM) is shown beside it. T is the work between the end of one capture and
the start of the next, which is what the interval timer counts (IntervalClock, below). The result is
bounded by the policy's min_interval and max_interval (policy.JobPolicy.auto_bounds); until a capture has
been measured the job uses auto_first_interval. The root agents enforce min_interval whatever is chosen here.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

STALL_SAMPLES = 5               # the median of this many recent periodic captures is C


def young(c: float, m: float) -> float:
    return math.sqrt(2 * c * m)


def daly(c: float, m: float) -> float:
    """Daly's interval for capture cost `c` and mean time between interruptions `m` (seconds)."""
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


@dataclass(frozen=True)
class AutoSettings:
    """From the hosting task's plan (the root agent's config and the job's policy)."""
    min_s: int
    max_s: int
    first_s: int
    mtbi_s: float                   # the site's M until the agent says what accounting saw
    min_from: str = ""              # the policy entries the bounds come from ("" built-in)
    max_from: str = ""
    stalls: tuple[float, ...] = ()  # measured by an earlier run of the job (before its requeue)

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> AutoSettings | None:
        auto = plan.get("auto")
        if not isinstance(auto, dict):
            return None
        stalls = tuple(float(s) for s in auto.get("stalls", ()) if isinstance(s, (int, float)) and s >= 0)
        return cls(int(auto["min_s"]), int(auto["max_s"]), int(auto["first_s"]), float(auto["mtbi_s"]),
                   str(auto.get("min_from") or ""), str(auto.get("max_from") or ""), stalls[-STALL_SAMPLES:])

    def as_dict(self) -> dict[str, Any]:
        return {"min_s": self.min_s, "max_s": self.max_s, "first_s": self.first_s, "mtbi_s": self.mtbi_s,
                "min_from": self.min_from, "max_from": self.max_from, "stalls": list(self.stalls)}


@dataclass(frozen=True)
class Choice:
    """The interval chosen and everything it was chosen from (status shows it)."""
    interval_s: int
    basis: str                      # "first" (nothing measured yet) | "daly"
    stall_s: float | None           # C: the median of `stalls`
    stalls: tuple[float, ...]
    mtbi_s: float                   # M of the job
    interruptions: dict[str, Any]             # the agent's answer (interruptions.answer), or {"source": "default"}
    young_s: float | None
    daly_s: float | None
    bound: str                      # "" | "min_interval" | "max_interval": the bound that set interval_s
    min_s: int
    max_s: int
    min_from: str
    max_from: str
    chosen_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "basis": self.basis, "stall_s": self.stall_s,
                "stalls": list(self.stalls), "mtbi_s": self.mtbi_s, "interruptions": dict(self.interruptions),
                "young_s": self.young_s, "daly_s": self.daly_s, "bound": self.bound, "min_s": self.min_s,
                "max_s": self.max_s, "min_from": self.min_from, "max_from": self.max_from,
                "chosen_at": self.chosen_at}

    def describe(self) -> str:
        """One line for the job's stderr."""
        if self.basis == "first":
            why = "no capture measured yet"
        else:
            why = (f"Daly: stall {self.stall_s:.2f}s (median of {len(self.stalls)} capture(s)), "
                   f"MTBI {_span(self.mtbi_s)} ({_source(self.interruptions)})")
        if self.bound:
            where = self.min_from if self.bound == "min_interval" else self.max_from
            why += f"; {self.bound} {_span(self.interval_s)} of {where or 'slurmckpt'}"
        return f"checkpoint interval auto: {self.interval_s}s ({why})"


def _span(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.3g}{unit}"
    return f"{seconds:.3g}s"


def _source(answer: dict[str, Any]) -> str:
    if answer.get("source") == "accounting":
        return (f"accounting: {answer.get('interruptions', 0)} interruption(s) in "
                f"{float(answer.get('node_s', 0)) / 3600:.3g} node-hours of partition {answer.get('partition')}"
                + (f", {answer['nodes']} nodes" if answer.get("nodes", 1) > 1 else ""))
    return "the site's interruption_mtbi" + (" until accounting answers" if answer.get("source") == "pending" else "")


@dataclass
class AutoInterval:
    settings: AutoSettings
    clock: Callable[[], float] = time.time
    stalls: deque[Any] = field(default_factory=lambda: deque(maxlen=STALL_SAMPLES))
    interruptions: dict[str, Any] = field(default_factory=lambda: {"source": "default"})

    def __post_init__(self) -> None:
        self.stalls.extend(self.settings.stalls)
        self.mtbi_s = self.settings.mtbi_s
        self.current = self.choose()

    def observe(self, result: dict[str, Any]) -> bool:
        """An epoch ended: a committed periodic capture's stall is a sample of C. True: the interval changed."""
        stall = result.get("stall_s")
        if result.get("status") != "committed" or result.get("final") or not isinstance(stall, (int, float)):
            return False
        self.stalls.append(max(0.0, float(stall)))
        return self._rechoose()

    def heard(self, answer: dict[str, Any]) -> bool:
        """The agent's word on interruptions (interruptions.answer). True: the interval changed."""
        mtbi = answer.get("mtbi_s")
        if not isinstance(mtbi, (int, float)) or not mtbi > 0 or not math.isfinite(mtbi):
            return False
        self.interruptions, self.mtbi_s = dict(answer), float(mtbi)
        return self._rechoose()

    def _rechoose(self) -> bool:
        old, self.current = self.current, self.choose()
        return (old.interval_s, old.basis, old.bound) != (self.current.interval_s, self.current.basis,
                                                          self.current.bound)

    def choose(self) -> Choice:
        s = self.settings
        low, high = s.min_s, max(s.min_s, s.max_s)
        c = statistics.median(self.stalls) if self.stalls else None
        y = d = None
        if c is None:
            wanted, basis = float(s.first_s), "first"
        else:
            # a capture too fast to time still costs something: a 10 ms floor keeps sqrt(2CM) meaningful
            y, d = young(max(c, 0.01), self.mtbi_s), daly(max(c, 0.01), self.mtbi_s)
            wanted, basis = d, "daly"
        interval = int(round(min(max(wanted, low), high)))
        bound = "min_interval" if wanted < low else "max_interval" if wanted > high else ""
        return Choice(interval, basis, c, tuple(self.stalls), self.mtbi_s, dict(self.interruptions), y, d, bound,
                      low, high, s.min_from, s.max_from, self.clock())


@dataclass
class IntervalClock:
    """Periodic captures, in the coordinator process: due once `interval` seconds have passed since the last
    epoch of any kind ended (a manual or failed capture restarts the count too)."""
    clock: Callable[[], float] = time.monotonic
    _last: float = field(default=0.0)

    def __post_init__(self) -> None:
        self._last = self.clock()

    def epoch_ended(self) -> None:
        self._last = self.clock()

    def seconds_to_next(self, interval: int) -> float | None:
        """None: no interval."""
        return max(0.0, self._last + interval - self.clock()) if interval > 0 else None

    def due(self, interval: int) -> bool:
        if interval > 0 and self.clock() - self._last >= interval:
            self._last = self.clock()
            return True
        return False
