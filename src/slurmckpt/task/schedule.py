"""When to capture: the interval (`IntervalClock`, run by the job's coordinator process) and the job's
wall-time (`Schedule`, run by the wrapper that hosts the coordinator: EndTime minus a margin learnt from the
last capture's duration, so no `--signal` is needed from the user)."""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("slurmckpt.triggers")

# `slurmckpt checkpoint | requeue JOB` (scancel --batch --signal, Slurm authorises it): real-time signals
# whose default action ends a process, so the CLI sends them only to a job whose batch step is wrapped.
CHECKPOINT_SIGNAL = signal.SIGRTMIN + 4     # capture, keep running
REQUEUE_SIGNAL = signal.SIGRTMIN + 5        # capture, then requeue
# What starts an epoch (its trigger, its commit's reason): the interval (coordinator/host.py), the wall-time
# (Schedule), Slurm's SIGTERM, `slurmckpt checkpoint` and `slurmckpt requeue` (wrapper.py)
TRIGGERS = ("interval", "walltime", "sigterm", "manual", "manual-requeue")


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


@dataclass
class Schedule:
    """The wall-time capture of a job with a time limit."""
    end_time: float | None            # epoch seconds, None = no time limit
    margin_s: float
    clock: Callable[[], float] = time.time
    last_capture_s: float = 0.0
    _walltime_fired: bool = False

    @classmethod
    def for_job(cls, env, config) -> "Schedule":
        from slurmckpt.errors import SlurmckptError
        from slurmckpt.slurm.control import default_control
        end = None
        try:
            end = default_control().end_time(env.job_id)
        except SlurmckptError as e:
            log.warning("cannot read the job's end time (%s): no wall-time capture", e)
        return cls(end, config.walltime_margin_s)

    def captured(self, seconds: float) -> None:
        self.last_capture_s = seconds

    def walltime_at(self) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - max(self.margin_s, 3 * self.last_capture_s + 10)

    def seconds_to_next(self) -> float:
        candidates = [5.0]
        at = self.walltime_at()
        if at is not None and not self._walltime_fired:
            candidates.append(at - self.clock())
        return max(0.05, min(candidates))

    def due(self) -> list[tuple[str, bool]]:
        at = self.walltime_at()
        if at is not None and not self._walltime_fired and self.clock() >= at:
            self._walltime_fired = True
            return [("walltime", True)]
        return []
