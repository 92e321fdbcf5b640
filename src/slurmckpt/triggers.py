"""When to capture: the interval, and the job's wall-time (EndTime minus a margin learnt from the last
capture's duration, so no `--signal` is needed from the user)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("slurmckpt.triggers")


@dataclass
class Schedule:
    end_time: float | None            # epoch seconds, None = no time limit
    margin_s: float
    clock: Callable[[], float] = time.time
    last_capture_s: float = 0.0
    _last: float = field(default=0.0)
    _walltime_fired: bool = False

    def __post_init__(self) -> None:
        self._last = self.clock()

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
        self._last = self.clock()

    def walltime_at(self) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - max(self.margin_s, 3 * self.last_capture_s + 10)

    def seconds_to_next(self, interval: int = 0) -> float:
        candidates = [5.0]
        if interval > 0:
            candidates.append(self._last + interval - self.clock())
        at = self.walltime_at()
        if at is not None and not self._walltime_fired:
            candidates.append(at - self.clock())
        return max(0.05, min(candidates))

    def due(self, interval: int) -> list[tuple[str, bool]]:
        now, out = self.clock(), []
        at = self.walltime_at()
        if at is not None and not self._walltime_fired and now >= at:
            self._walltime_fired = True
            out.append(("walltime", True))
        elif interval > 0 and now - self._last >= interval:
            self._last = now
            out.append(("interval", False))
        return out
