"""barrier/rounds.py: the coordinator's lock rounds retry an attempt only when it failed retryably (its
error's type, carried as error_kind), back off with jitter that grows with the round, and stop at the bound."""
from __future__ import annotations

import asyncio

import pytest

from slurmckpt.barrier.rounds import LockRounds


def run(rounds: LockRounds, results: list[dict]) -> tuple[dict, int, list[float]]:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def attempt() -> dict:
        return results.pop(0)

    rounds.sleep = sleep
    result, n = asyncio.run(rounds.run(attempt))
    return result, n, slept


RETRY = {"status": "aborted", "error_kind": "retryable", "error": "lock timed out"}


def test_retryable_failures_are_tried_again_until_a_round_commits():
    result, n, slept = run(LockRounds(8, 0.1, random=lambda: 0.5), [RETRY, RETRY, {"status": "committed"}])
    assert result == {"status": "committed"} and n == 3
    assert slept == pytest.approx([0.15, 0.30])          # backoff_s * (1 + jitter) * round


@pytest.mark.parametrize("kind", ["fatal", "ended", None])
def test_any_other_failure_ends_the_rounds_at_once(kind):
    failed = {"status": "aborted", "error": "lock file is held", **({"error_kind": kind} if kind else {})}
    result, n, slept = run(LockRounds(8, 0.1), [failed, {"status": "committed"}])
    assert result is failed and n == 1 and slept == []


def test_the_last_allowed_round_is_the_answer():
    result, n, slept = run(LockRounds(2, 0.1, random=lambda: 0.0), [RETRY, dict(RETRY, error="again")])
    assert result["error"] == "again" and n == 2 and slept == [0.1]
    with pytest.raises(ValueError):
        run(LockRounds(0), [RETRY])
