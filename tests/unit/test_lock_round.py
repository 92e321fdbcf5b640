"""Lock rounds over GPU ranks, driven against the fake driver's NCCL-like collectives: a round fails while a
collective is half entered, the ranks are unlocked and make progress during the backoff, a later round cuts;
bounded retries end in an abort with every rank unlocked."""
from __future__ import annotations

import threading
from pathlib import Path
import time

import pytest

from slurmckpt import procfs
from slurmckpt.barrier.lock_round import (LockRound, LockRoundAborted, LockRoundResult, RankLock, UnlockFailed,
                                          run_in_threads)
from slurmckpt.cuda.driver import ProcessState
from slurmckpt.cuda.fake import FakeGpuDriver, fake_gpus
from slurmckpt.cuda.stage import GpuProcess, GpuStage, GpuUnsupportedError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def sequential(calls):
    """Rank by rank, in order: deterministic interleaving for the fake clock."""
    return [run_in_threads([c])[0] for c in calls]


@pytest.fixture(autouse=True)
def no_proc(tmp_path: Path):
    """The fake driver's pids are no processes of this machine: procfs.py sees an empty /proc."""
    with procfs.rooted(tmp_path / "no-proc"):
        yield


def make_ranks(driver: FakeGpuDriver, pids: list[int]) -> tuple[list[RankLock], list[GpuStage]]:
    """One rank per pid, each a GpuStage on the fake driver (what the agent runs for its tree)."""
    stages, ranks = [], []
    for rank, pid in enumerate(pids):
        driver.add_process(pid)
        stage = GpuStage(driver, [GpuProcess(pid, pid, ProcessState.RUNNING)])
        stages.append(stage)
        ranks.append(RankLock(rank, stage.lock_all, stage.unlock_all))
    return ranks, stages


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def driver(clock: Clock) -> FakeGpuDriver:
    # the lock's wait only lets time pass; workload progress happens in the round's backoff (below)
    return FakeGpuDriver(fake_gpus(2), sleep=clock.advance, clock=clock)


def test_all_ranks_lock_in_the_first_round(driver, clock):
    ranks, _ = make_ranks(driver, [1, 2, 3])
    result = LockRound(ranks, timeout_ms=500, clock=clock, sleep=clock.advance, concurrently=sequential).run()
    assert isinstance(result, LockRoundResult) and result.rounds == 1 and result.time_to_cut_s == 0.0
    assert set(driver.states().values()) == {ProcessState.LOCKED}


def test_half_entered_collective_fails_a_round_then_the_cut_succeeds(driver, clock):
    ranks, _ = make_ranks(driver, [1, 2])
    coll = driver.collective([1, 2])
    driver.enter(coll, 1)                          # rank 0 waits in an all-reduce that rank 1 has not reached
    slept = []

    def backoff(s: float) -> None:                 # the unlocked ranks run during the backoff
        slept.append(s)
        clock.advance(s)
        driver.step()

    result = LockRound(ranks, timeout_ms=200, backoff_s=0.1, clock=clock, sleep=backoff, random=lambda: 0.5,
                       concurrently=sequential).run()
    assert result.rounds == 2 and coll.complete
    assert list(result.records[0].failed) == [0] and "CUDA_ERROR_NOT_READY" in result.records[0].failed[0]
    assert result.records[1].failed == {}
    assert slept == [0.1]                          # d * (0.5 + 0.5)
    assert result.time_to_cut_s == pytest.approx(0.2 + 0.1)   # one lock timeout + one backoff
    assert ("unlock", 2) in driver.calls           # rank 1 had locked in round 1: it was let go
    assert driver.states() == {1: ProcessState.LOCKED, 2: ProcessState.LOCKED}


def test_never_a_cut_aborts_after_bounded_rounds_with_everyone_unlocked(driver, clock):
    ranks, _ = make_ranks(driver, [1, 2, 3])
    coll = driver.collective([1, 2, 3])
    driver.enter(coll, 1)                          # rank 2 (pid 3) never progresses: no step() at all
    sleeps = []
    lr = LockRound(ranks, timeout_ms=100, max_rounds=3, clock=clock, sleep=lambda s: (sleeps.append(s),
                   clock.advance(s)), concurrently=sequential)
    with pytest.raises(LockRoundAborted, match="after 3 lock rounds") as e:
        lr.run()
    assert len(e.value.records) == 3 and len(sleeps) == 2
    assert all(r.failed.keys() == {0} for r in e.value.records)
    assert set(driver.states().values()) == {ProcessState.RUNNING}
    assert [op for op, pid in driver.calls if pid == 2].count("unlock") == 3


def test_threads_lock_concurrently_and_retry_in_real_time():
    driver = FakeGpuDriver(fake_gpus(2))           # real time, real threads
    ranks, _ = make_ranks(driver, [1, 2])
    coll = driver.collective([1, 2])
    driver.enter(coll, 1)
    threads_seen: set[str] = set()
    inner = ranks[0].lock

    def lock0(ms: int) -> None:
        threads_seen.add(threading.current_thread().name)
        inner(ms)
    ranks[0] = RankLock(0, lock0, ranks[0].unlock)

    def backoff(s: float) -> None:
        time.sleep(s)
        driver.step()

    t = time.monotonic()
    result = LockRound(ranks, timeout_ms=50, backoff_s=0.01, sleep=backoff).run()
    assert result.rounds == 2 and 0.05 <= result.time_to_cut_s < 2.0 and time.monotonic() - t < 2.0
    assert all(name.startswith("lock-round") for name in threads_seen)


def test_unsupported_rank_aborts_at_once(driver, clock):
    ranks, _ = make_ranks(driver, [1, 2])

    def refuse(ms: int) -> None:
        raise GpuUnsupportedError(["pid 9 uses a MIG instance"])
    ranks[1] = RankLock(1, refuse, lambda: None)
    with pytest.raises(LockRoundAborted, match="no retry can fix.*MIG") as e:
        LockRound(ranks, clock=clock, sleep=clock.advance, concurrently=sequential).run()
    assert len(e.value.records) == 1 and driver.state(1) is ProcessState.RUNNING


def test_unlock_failure_stops_everything(driver, clock):
    ranks, _ = make_ranks(driver, [1, 2])
    driver.busy(2, 10.0)

    def broken_unlock() -> None:
        raise ConnectionError("agent of rank 0 unreachable")
    ranks[0] = RankLock(0, ranks[0].lock, broken_unlock)
    with pytest.raises(UnlockFailed) as e:
        LockRound(ranks, timeout_ms=100, clock=clock, sleep=clock.advance, concurrently=sequential).run()
    assert list(e.value.ranks) == [0] and "unreachable" in e.value.ranks[0]


def test_deadline_gives_up_before_sleeping_past_it(driver, clock):
    ranks, _ = make_ranks(driver, [1])
    driver.busy(1, 100.0)
    with pytest.raises(LockRoundAborted, match="within 1.0 s"):
        LockRound(ranks, timeout_ms=400, max_rounds=50, backoff_s=0.5, deadline_s=1.0, random=lambda: 0.99,
                  clock=clock, sleep=clock.advance, concurrently=sequential).run()
    assert clock.now < 1.0 + 0.4


def test_backoff_is_jittered_exponential_and_capped():
    lr = LockRound([], backoff_s=0.1, backoff_max_s=1.0, random=lambda: 0.0)
    assert [lr.backoff(i) for i in (1, 2, 3, 4, 5, 6)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    lr.random = lambda: 0.999999
    assert lr.backoff(1) == pytest.approx(0.15, rel=1e-4) and lr.backoff(10) == pytest.approx(1.5, rel=1e-4)


def test_no_ranks_is_an_empty_cut():
    assert LockRound([]).run() == LockRoundResult(0, 0.0, [])
