"""When to capture, besides the interval (`coordinator.interval.IntervalClock`, run by the job's coordinator
process): the job's wall-time (`Schedule`, run by the wrapper that hosts the coordinator: EndTime minus a
margin learnt from the last capture's duration, so no `--signal` is needed from the user)."""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from slurmckpt.config import Config
    from slurmckpt.slurm.env import TaskEnv

log = logging.getLogger("slurmckpt.triggers")

# `slurmckpt checkpoint | requeue JOB` (scancel --batch --signal, Slurm authorises it): real-time signals
# whose default action ends a process, so the CLI sends them only to a job whose batch step is wrapped.
CHECKPOINT_SIGNAL = signal.SIGRTMIN + 4     # capture, keep running
REQUEUE_SIGNAL = signal.SIGRTMIN + 5        # capture, then requeue
# What starts an epoch, this wall-time capture among them: coordinator/protocol.py, TRIGGERS


@dataclass
class Schedule:
    """The wall-time capture of a job with a time limit."""
    end_time: float | None            # epoch seconds, None = no time limit
    margin_s: float
    clock: Callable[[], float] = time.time
    last_capture_s: float = 0.0
    _walltime_fired: bool = False

    @classmethod
    def for_job(cls, env: TaskEnv, config: Config) -> "Schedule":
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
