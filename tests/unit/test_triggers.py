"""When to capture: interval and wall-time (EndTime minus a margin learnt from the last capture)."""
from __future__ import annotations

import pytest

from slurmckpt.triggers import Schedule


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_interval_fires_once_per_interval(clock):
    s = Schedule(None, 45, clock=clock)
    assert s.due(60) == []
    clock.now += 59.9
    assert s.due(60) == []
    clock.now += 0.1
    assert s.due(60) == [("interval", False)]
    assert s.due(60) == []                                 # not again until another interval passed
    clock.now += 30
    assert s.due(60) == []
    clock.now += 30
    assert s.due(60) == [("interval", False)]


def test_interval_disabled(clock):
    s = Schedule(None, 45, clock=clock)
    clock.now += 10 ** 6
    assert s.due(0) == []
    assert s.seconds_to_next(0) == 5.0                     # just the poll period


def test_capture_restarts_the_interval(clock):
    s = Schedule(None, 45, clock=clock)
    clock.now += 50
    s.captured(3.0)                                        # e.g. a manual checkpoint
    clock.now += 50
    assert s.due(60) == []
    clock.now += 10
    assert s.due(60) == [("interval", False)]


def test_seconds_to_next(clock):
    s = Schedule(None, 45, clock=clock)
    assert s.seconds_to_next(60) == 5.0
    clock.now += 57
    assert s.seconds_to_next(60) == pytest.approx(3.0)
    clock.now += 100                                       # overdue: poll soon, never negative
    assert s.seconds_to_next(60) == 0.05


def test_walltime_fires_margin_before_end(clock):
    end = clock.now + 1000
    s = Schedule(end, 45, clock=clock)
    assert s.walltime_at() == end - 45                    # no capture yet: max(45, 3*0+10)
    clock.now = end - 46
    assert s.due(0) == []
    clock.now = end - 45
    assert s.due(0) == [("walltime", True)]
    clock.now += 1
    assert s.due(0) == []                                  # only once


def test_walltime_margin_learnt_from_capture_duration(clock):
    end = clock.now + 10_000
    s = Schedule(end, 45, clock=clock)
    s.captured(30.0)                                       # a slow capture: 3*30+10 = 100 s of lead
    assert s.walltime_at() == end - 100
    clock.now = end - 101
    assert s.due(0) == []
    clock.now = end - 100
    assert s.due(0) == [("walltime", True)]


def test_short_capture_keeps_configured_margin(clock):
    s = Schedule(clock.now + 500, 45, clock=clock)
    s.captured(5.0)                                        # 3*5+10 = 25 < 45
    assert s.walltime_at() == clock.now + 500 - 45
    s.captured(12.0)                                       # 46 > 45
    assert s.walltime_at() == clock.now + 500 - 46


def test_walltime_wins_over_interval(clock):
    end = clock.now + 100
    s = Schedule(end, 45, clock=clock)
    clock.now = end - 40                                   # past the walltime point and an interval
    assert s.due(30) == [("walltime", True)]


def test_seconds_to_next_sees_walltime(clock):
    s = Schedule(clock.now + 47, 45, clock=clock)
    assert s.seconds_to_next(3600) == pytest.approx(2.0)
    clock.now += 2
    s.due(3600)
    assert s.seconds_to_next(3600) == 5.0                  # fired: no longer a candidate


def test_no_end_time_never_walltime(clock):
    s = Schedule(None, 45, clock=clock)
    assert s.walltime_at() is None
    clock.now += 10 ** 9
    assert ("walltime", True) not in s.due(0)
