"""When to capture: the interval (coordinator process) and wall-time (EndTime minus a margin learnt from the
last capture)."""
from __future__ import annotations

import pytest

from slurmckpt.coordinator.interval import IntervalClock
from slurmckpt.task.schedule import Schedule


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_interval_fires_once_per_interval(clock):
    c = IntervalClock(clock)
    assert not c.due(60)
    clock.now += 59.9
    assert not c.due(60)
    clock.now += 0.1
    assert c.due(60)
    assert not c.due(60)                                   # not again until another interval passed
    clock.now += 30
    assert not c.due(60)
    clock.now += 30
    assert c.due(60)


def test_interval_disabled(clock):
    c = IntervalClock(clock)
    clock.now += 10 ** 6
    assert not c.due(0)
    assert c.seconds_to_next(0) is None


def test_an_epoch_of_any_kind_restarts_the_interval(clock):
    c = IntervalClock(clock)
    clock.now += 50
    c.epoch_ended()                                        # e.g. a manual checkpoint
    clock.now += 50
    assert not c.due(60)
    clock.now += 10
    assert c.due(60)


def test_interval_seconds_to_next(clock):
    c = IntervalClock(clock)
    assert c.seconds_to_next(60) == 60
    clock.now += 57
    assert c.seconds_to_next(60) == pytest.approx(3.0)
    clock.now += 100                                       # overdue: now, never negative
    assert c.seconds_to_next(60) == 0.0


def test_walltime_fires_margin_before_end(clock):
    end = clock.now + 1000
    s = Schedule(end, 45, clock=clock)
    assert s.walltime_at() == end - 45                    # no capture yet: max(45, 3*0+10)
    clock.now = end - 46
    assert s.due() == []
    clock.now = end - 45
    assert s.due() == [("walltime", True)]
    clock.now += 1
    assert s.due() == []                                   # only once


def test_walltime_margin_learnt_from_capture_duration(clock):
    end = clock.now + 10_000
    s = Schedule(end, 45, clock=clock)
    s.captured(30.0)                                       # a slow capture: 3*30+10 = 100 s of lead
    assert s.walltime_at() == end - 100
    clock.now = end - 101
    assert s.due() == []
    clock.now = end - 100
    assert s.due() == [("walltime", True)]


def test_short_capture_keeps_configured_margin(clock):
    s = Schedule(clock.now + 500, 45, clock=clock)
    s.captured(5.0)                                        # 3*5+10 = 25 < 45
    assert s.walltime_at() == clock.now + 500 - 45
    s.captured(12.0)                                       # 46 > 45
    assert s.walltime_at() == clock.now + 500 - 46


def test_seconds_to_next_sees_walltime(clock):
    s = Schedule(clock.now + 47, 45, clock=clock)
    assert s.seconds_to_next() == pytest.approx(2.0)
    clock.now += 2
    s.due()
    assert s.seconds_to_next() == 5.0                      # fired: no longer a candidate


def test_no_end_time_never_walltime(clock):
    s = Schedule(None, 45, clock=clock)
    assert s.walltime_at() is None
    clock.now += 10 ** 9
    assert s.due() == [] and s.seconds_to_next() == 5.0
