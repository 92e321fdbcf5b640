"""compression.read_ahead: the store's frames are read by a thread of their own, ahead of the unpacking."""
from __future__ import annotations

import threading
import time

import pytest

from slurmckpt.compression import read_ahead


def test_items_arrive_in_order_and_the_producer_runs_ahead_on_its_own_thread() -> None:
    seen: list[str] = []

    def items():
        for i in range(50):
            seen.append(threading.current_thread().name)
            yield i
    it = read_ahead(items(), 4)
    assert next(it) == 0
    time.sleep(0.2)
    assert 2 <= len(seen) <= 6          # read ahead, but no further than the depth (+ the one in hand)
    assert list(it) == list(range(1, 50))
    assert set(seen) == {"slurmckpt-read-ahead"}


def test_a_failed_read_is_raised_after_the_items_before_it() -> None:
    def items():
        yield 1
        yield 2
        raise ValueError("truncated: 3 of 8 bytes")
    got = []
    with pytest.raises(ValueError, match="truncated"):
        for x in read_ahead(items(), 8):
            got.append(x)
    assert got == [1, 2]


def test_a_consumer_that_stops_early_stops_the_reader() -> None:
    produced = []

    def items():
        for i in range(10_000):
            produced.append(i)
            yield i
    it = read_ahead(items(), 2)
    assert next(it) == 0
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "slurmckpt-read-ahead"]
    assert len(produced) < 10
