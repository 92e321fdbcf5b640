"""Lock rounds: a consistent cut across the GPU ranks of a job (docs/architecture.md, GPU lock rounds).

cuCheckpointProcessLock waits for submitted GPU work. A rank inside an NCCL collective whose peer is already
locked never finishes that collective, so its lock times out. One round therefore locks every rank at once
with a short timeout; if any rank fails, every rank is unlocked (unlock must be idempotent: a rank with
nothing locked does nothing). When every failure is typed retryable (errors.LockContended: the lock timed out
on work in flight) the round backs off with jitter (so the ranks' collectives can progress) and tries again;
any other error aborts at once, whatever its text says. A cut exists only when every rank locked in the same round; after `max_rounds` failed rounds (or
past `deadline_s`) the attempt is given up with LockRoundAborted, every rank unlocked, the job running on.

Pure logic: ranks are callables (the coordinator's RPC to each rank's agent, or GpuStage methods in tests);
clock, sleep, random and the way calls run concurrently are injected.
"""
from __future__ import annotations

import logging
import random as _random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from slurmckpt.errors import SlurmckptError, is_retryable

log = logging.getLogger("slurmckpt.barrier")


@dataclass(frozen=True)
class RankLock:
    """One rank's side of a round. `lock(timeout_ms)` raises on failure; `unlock()` is idempotent."""
    rank: Hashable
    lock: Callable[[int], None]
    unlock: Callable[[], None]


@dataclass
class RoundRecord:
    index: int                                   # 1-based
    started_s: float                             # since the first round started
    duration_s: float
    failed: dict[Hashable, str] = field(default_factory=dict)   # rank -> error text


@dataclass
class LockRoundResult:
    rounds: int                                  # rounds needed, the successful one included
    time_to_cut_s: float                         # from the first lock call to every rank locked
    records: list[RoundRecord]


class LockRoundError(SlurmckptError):
    """A lock round could not go on; `records` holds every round tried."""

    def __init__(self, message: str, records: list[RoundRecord], **context: object) -> None:
        self.records = records
        super().__init__(message, **context)


class LockRoundAborted(LockRoundError):
    """No round locked every rank within the bounds; every rank was unlocked, the epoch aborts."""


class UnlockFailed(LockRoundError):
    """A rank could not be unlocked after a failed round: `ranks` may still be locked. Never retried."""

    def __init__(self, message: str, records: list[RoundRecord], ranks: dict[Hashable, str],
                 **context: object) -> None:
        self.ranks = ranks
        super().__init__(message, records, **context)


Outcome = BaseException | None


def run_in_threads(calls: Sequence[Callable[[], None]]) -> list[Outcome]:
    """Run every call at the same time (one thread each); return each one's exception or None."""
    def guarded(fn: Callable[[], None]) -> Outcome:
        try:
            fn()
        except BaseException as e:   # noqa: BLE001 - reported per rank, never swallowed
            return e
        return None
    if len(calls) <= 1:
        return [guarded(c) for c in calls]
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="lock-round") as pool:
        return list(pool.map(guarded, calls))


@dataclass
class LockRound:
    ranks: Sequence[RankLock]
    timeout_ms: int = 2000
    max_rounds: int = 8
    backoff_s: float = 0.05                      # first backoff; doubles each round
    backoff_max_s: float = 2.0
    deadline_s: float | None = None              # give up when no cut within this (checked between rounds)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    random: Callable[[], float] = _random.random
    concurrently: Callable[[Sequence[Callable[[], None]]], list[Outcome]] = run_in_threads
    retryable: Callable[[BaseException], bool] = is_retryable      # typed: LockContended, ExchangeInFlight
    context: dict = field(default_factory=dict)

    def backoff(self, round_index: int) -> float:
        """Jittered exponential backoff after failed round `round_index`: uniform in [d/2, 3d/2)."""
        d = min(self.backoff_max_s, self.backoff_s * (2 ** (round_index - 1)))
        return d * (0.5 + self.random())

    def run(self) -> LockRoundResult:
        if not self.ranks:
            return LockRoundResult(0, 0.0, [])
        if self.max_rounds < 1:
            raise ValueError("max_rounds must be >= 1")
        start = self.clock()
        records: list[RoundRecord] = []
        for index in range(1, self.max_rounds + 1):
            t0 = self.clock()
            outcomes = self.concurrently([self._locker(r) for r in self.ranks])
            rec = RoundRecord(index, t0 - start, self.clock() - t0,
                              {r.rank: f"{type(e).__name__}: {e}" for r, e in zip(self.ranks, outcomes) if e})
            records.append(rec)
            if not rec.failed:
                cut = self.clock() - start
                log.info("consistent cut after %d round(s), %.3f s", index, cut, extra=self.context)
                return LockRoundResult(index, cut, records)
            log.info("lock round %d failed on rank(s) %s; unlocking all", index, sorted(map(str, rec.failed)),
                     extra=self.context)
            self._unlock_all(records)
            fatal = [e for e in outcomes if e is not None and not self.retryable(e)]
            if fatal:
                raise LockRoundAborted(f"lock round {index}: rank error that no retry can fix: {fatal[0]}",
                                       records, **self.context) from fatal[0]
            if index == self.max_rounds:
                break
            pause = self.backoff(index)
            if self.deadline_s is not None and self.clock() - start + pause > self.deadline_s:
                raise LockRoundAborted(f"no consistent cut within {self.deadline_s} s ({index} rounds)",
                                       records, **self.context)
            self.sleep(pause)
        raise LockRoundAborted(f"no consistent cut after {self.max_rounds} lock rounds; "
                               f"last failures: {records[-1].failed}", records, **self.context)

    def _locker(self, r: RankLock) -> Callable[[], None]:
        return lambda: r.lock(self.timeout_ms)

    def _unlock_all(self, records: list[RoundRecord]) -> None:
        outcomes = self.concurrently([r.unlock for r in self.ranks])
        bad = {r.rank: f"{type(e).__name__}: {e}" for r, e in zip(self.ranks, outcomes) if e is not None}
        if bad:
            first = next(e for e in outcomes if e is not None)
            raise UnlockFailed(f"could not unlock rank(s) {sorted(map(str, bad))} after a failed lock round",
                               records, bad, **self.context) from first
