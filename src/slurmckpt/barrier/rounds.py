"""GPU lock rounds, as the coordinator runs them (docs/architecture.md, "GPU lock rounds").

cuCheckpointProcessLock waits for work already submitted to the GPU; a rank inside an NCCL collective whose
peer is already locked never finishes it. PREPARE therefore locks every rank's GPUs at once with a short
timeout (one attempt of the epoch); if a lock times out the attempt aborts, which unlocks every rank, and a
new round starts after a jittered backoff, a bounded number of times. A cut exists only when every rank
locked in the same round. Whether a round is tried again follows the error's type, never its text: the
attempt's `error_kind` is "retryable" only when the failing rank's error was (errors.LockContended,
errors.ExchangeInFlight; coordinator/protocol.py carries it).
"""
from __future__ import annotations

import asyncio
import logging
import random as _random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

log = logging.getLogger("slurmckpt.coordinator")      # its lines stay the coordinator's (admins grep them)

Attempt = Callable[[], Awaitable[dict[str, Any]]]


def retryable(result: dict[str, Any]) -> bool:
    """An attempt that aborted on a rank's retryable error: another round may get every rank locked."""
    return result.get("status") == "aborted" and result.get("error_kind") == "retryable"


@dataclass
class LockRounds:
    max_rounds: int = 8
    backoff_s: float = 0.2          # round n waits backoff_s * n * U[1, 2) before round n + 1
    random: Callable[[], float] = _random.random
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)

    def backoff(self, round_no: int) -> float:
        return self.backoff_s * (1 + self.random()) * round_no

    async def run(self, attempt: Attempt) -> tuple[dict[str, Any], int]:
        """(the last attempt's result, how many rounds ran): the first that did not fail retryably, or the
        last one allowed."""
        if self.max_rounds < 1:
            raise ValueError("max_rounds must be >= 1")
        round_no = 1
        while True:
            result = await attempt()
            if not retryable(result) or round_no >= self.max_rounds:
                return result, round_no
            log.info("lock round %d failed (%s); retrying", round_no, result.get("error"))
            await self.sleep(self.backoff(round_no))
            round_no += 1
