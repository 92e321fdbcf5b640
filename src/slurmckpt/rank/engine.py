"""The one engine that runs a rank's named stage tables (capture.py: PREPARE, PERIODIC_CAPTURE, FINAL_CAPTURE,
RESUME, PERSIST; restore.py: RESTORE).

A `Table[S]` is a named, ordered tuple of `Stage[S](name, run, undo)`, each stage typed on the state it works
on (context.py: a CaptureState or a RestoreState) and taking the rank's frozen context with it. `run_table`
sets the epoch's phase the table names, runs the stages in order, times each one (unless it times itself)
and keeps it for the rollback; the first failure is named (`failed_stage`) and raised as it is, for the caller to roll back
(`rollback`) after what must come first (runner.py: a tree criu may have left its parasite in is killed before
the thaw). A settled table (RESUME's tree stages) runs every stage whatever the others do, and so does the
rollback: a tree left frozen or locked is worse than a logged error. A failure while undoing is added to the
message, never put in its place (the first failure is what the user and the admin need).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from slurmckpt.rank.context import EpochState, Phase

if TYPE_CHECKING:
    from slurmckpt.rank.context import RankContext

log = logging.getLogger("slurmckpt.rank")

S = TypeVar("S", bound=EpochState)


@dataclass(frozen=True)
class Stage(Generic[S]):
    name: str
    run: Callable[[RankContext, S], None]
    undo: Callable[[RankContext, S], None] | None = None
    # the stage writes its own `st.timings` entries: work it runs beside another stage is timed under the
    # name it has where it runs alone (capture.py: a periodic capture's host copy beside criu's dump)
    times_itself: bool = False


@dataclass(frozen=True)
class Table(Generic[S]):
    """A named table: its stages in order, the phase the epoch is in while it runs and the one it reached
    once every stage is done. A `settled` table runs every stage whatever the others do (nothing to undo,
    nothing timed); its failures are raised together (Unsettled)."""
    name: str
    stages: tuple[Stage[S], ...]
    running: Phase
    reached: Phase
    settled: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)


@dataclass
class Failure:
    stage: str
    error: BaseException

    def __str__(self) -> str:
        return f"{self.stage}: {self.error}"


class Unsettled(Exception):
    """A settled table's stages that failed, in the order they did (every other stage ran)."""

    def __init__(self, table: str, failures: list[Failure]) -> None:
        super().__init__(f"{table}: " + "; ".join(map(str, failures)))
        self.failures = failures


def run_table(table: Table[S], ctx: RankContext, st: S) -> None:
    """Run `table` over `st`. Each stage done is appended to `st.done` and timed in `st.timings`; the first
    that raises is recorded in `st` (`stage_failed`) and its error raised, the stages done kept for `rollback`.
    A settled table: every stage, then Unsettled if any failed."""
    st.phase = table.running
    if table.settled:
        failures = _settle([(s.name, s.run) for s in table.stages], ctx, st)
        if failures:
            raise Unsettled(table.name, failures)
        st.phase = table.reached
        return
    for stage in table.stages:
        start = time.monotonic()
        try:
            stage.run(ctx, st)
        except Exception:  # named here; the caller rolls back
            st.stage_failed(stage.name)
            raise
        if not stage.times_itself:
            st.timings[stage.name] = round(time.monotonic() - start, 4)
        st.done.append(stage)
        _stall(ctx, st, stage.name)
    st.phase = table.reached


def rollback(ctx: RankContext, st: S) -> list[Failure]:
    """The undos of the stages done, last first, each whatever the others do; the failures, in the order
    they happened. Nothing is left to undo after it."""
    failures = _settle([(s.name, s.undo) for s in reversed(st.done) if s.undo is not None], ctx, st)
    st.done = []
    st.phase = Phase.ROLLED_BACK
    return failures


def _settle(steps: list[tuple[str, Callable[[RankContext, S], None]]], ctx: RankContext, st: S) -> list[Failure]:
    failures = []
    for name, step in steps:
        try:
            step(ctx, st)
        except Exception as e:  # keep going: a tree left frozen is worse than a logged error
            failures.append(Failure(name, e))
    return failures


def _stall(ctx: RankContext, st: EpochState, stage: str) -> None:
    """Config.debug_stall_after (tests only): pause every rank after a stage, to kill something there."""
    if ctx.limits.stall_after and ctx.limits.stall_after[0] == stage:
        log.warning("debug_stall_after: pausing %.1fs after %s of epoch %d", ctx.limits.stall_after[1], stage,
                    st.epoch)
        time.sleep(ctx.limits.stall_after[1])
