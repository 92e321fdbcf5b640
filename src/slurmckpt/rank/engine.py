"""The one engine that runs a rank's stage tables (PREPARE, CAPTURE, RESUME: capture.py; RESTORE: restore.py).

A table is an ordered tuple of `Stage(name, run, undo)`; each stage takes the rank's frozen context and the
state of the epoch (context.py). `run_table` runs the stages in order, times each one, and on the first
failure undoes the stages done so far in reverse, naming the stage that failed; a failure while undoing is
added to the message, never put in its place (the first failure is what the user and the admin need).
`settle` runs every step it is given whatever the others do (RESUME's tree stages, and the rollback): a tree left
frozen or locked is worse than a logged error.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from slurmckpt.rank.context import EpochState, RankContext

log = logging.getLogger("slurmckpt.pipeline")

Step = Callable[["RankContext", "EpochState"], None]


@dataclass(frozen=True)
class Stage:
    name: str
    run: Step
    undo: Step | None = None


@dataclass
class Failure:
    stage: str
    error: BaseException

    def __str__(self) -> str:
        return f"{self.stage}: {self.error}"


def run_table(table: tuple[Stage, ...], ctx: RankContext, st: EpochState,
              on_failure: Callable[[str, BaseException], None]) -> None:
    """Run `table` in order; each stage done is appended to `st.done` and timed in `st.timings`. The first
    stage that raises is recorded in `st` (`stage_failed`) and handed to `on_failure(stage, error)`: the rollback,
    which raises what the caller gets (the error itself, or one that names it and what undoing it met)."""
    for stage in table:
        start = time.monotonic()
        try:
            stage.run(ctx, st)
        except Exception as e:  # an unexpected failure still rolls back
            st.stage_failed(stage.name)
            on_failure(stage.name, e)
            raise
        st.timings[stage.name] = round(time.monotonic() - start, 4)
        st.done.append(stage)
        _stall(ctx, st, stage.name)


def settle(steps: list[tuple[str, Step]], ctx: RankContext, st: EpochState) -> list[Failure]:
    """Run every step, whatever the others do; the failures, in the order they happened."""
    failures = []
    for name, step in steps:
        try:
            step(ctx, st)
        except Exception as e:  # keep going: a tree left frozen is worse than a logged error
            failures.append(Failure(name, e))
    return failures


def undo_steps(done: list[Stage]) -> list[tuple[str, Step]]:
    """The undos of the stages done, last first (the rollback)."""
    return [(s.name, s.undo) for s in reversed(done) if s.undo is not None]


def _stall(ctx: RankContext, st: EpochState, stage: str) -> None:
    """Config.debug_stall_after (tests only): pause every rank after a stage, to kill something there."""
    if ctx.limits.stall_after and ctx.limits.stall_after[0] == stage:
        log.warning("debug_stall_after: pausing %.1fs after %s of epoch %d", ctx.limits.stall_after[1], stage,
                    st.epoch)
        time.sleep(ctx.limits.stall_after[1])
