"""One rank, as the agent drives it: the phases the coordinator sends (SIZE, PREPARE, CAPTURE, RESUME, ABORT,
FINISH) and the restore, each one table run by the engine (capture.py, restore.py) over the context the
agent built (context.py). The runner keeps what outlives an epoch: the context of the tree it runs, the
current epoch's state, and why it killed the tree, if it did."""
from __future__ import annotations

import logging
import os
from typing import Any

from slurmckpt.errors import CaptureError, CriuInterrupted, SlurmckptError, TaskEnded
from slurmckpt.node import procfs, proctree
from slurmckpt.rank import capture, images, restore
from slurmckpt.rank.context import EpochState, RankContext, RestoreState
from slurmckpt.rank.engine import Failure, Stage, run_table, settle, undo_steps
from slurmckpt.rank.fit import Footprint, measure as measure_footprint
from slurmckpt.store.record import RankRecord

log = logging.getLogger("slurmckpt.pipeline")


class RankRunner:
    def __init__(self) -> None:
        self.ctx: RankContext | None = None      # the running tree's; None until the agent built one
        self.state: EpochState | None = None     # the current (or last) epoch's
        self.killed_for = ""                     # why this agent killed the tree (kill_tree)
        self._failed_stage = ""

    @property
    def failed_stage(self) -> str:
        """The stage that raised last (store/fresh_start.py records it; the coordinator's abort names it)."""
        return self._failed_stage or (self.state.failed_stage if self.state else "")

    @failed_stage.setter
    def failed_stage(self, stage: str) -> None:
        self._failed_stage = stage
        if self.state is not None:
            self.state.failed_stage = stage

    @property
    def root_pid(self) -> int | None:
        return self.ctx.root_pid if self.ctx else None

    @property
    def footprint(self) -> Footprint | None:
        return self.state.footprint if self.state else None

    # ---- phases driven by the coordinator ---------------------------------------------------------------
    def size(self, epoch: int) -> dict[str, Any]:
        """SIZE, before anything is locked: what this rank's capture will take (host memory, GPU memory per
        process, room in host memory and the store); refuses a capture that cannot fit, naming why."""
        ctx = self._require_tree()
        self.state = EpochState(epoch)
        try:
            measured = measure_footprint(ctx.cgroup.pids(), ctx.gpu, ctx.store.job_dir,
                                         raise_allowed=ctx.limits.memory_ledger is not None)
            why = measured.refusals()
            if why:
                raise CaptureError("capture refused before anything was locked: " + "; ".join(why),
                                   step=ctx.step, rank=ctx.rank)
        except SlurmckptError:
            self.failed_stage = "size"
            raise
        self.state.footprint = measured
        return {**measured.reply(), "notes": list(measured.gpu.notes) + measured.notes()}

    def prepare(self, epoch: int) -> dict[str, Any]:
        ctx = self._require_tree()
        sized = self.state.footprint if self.state and self.state.epoch == epoch else None
        st = self.state = EpochState(epoch, footprint=sized,
                                     replay=ctx.step == "batch" and proctree.has_slurm_client(ctx.cgroup.pids()))
        self._run(capture.PREPARE, ctx, st)
        return {"timings": st.timings}

    def capture(self, epoch: int, final: bool = True) -> dict[str, Any]:
        """A final capture hands its staged images to a persister that outlives the job (the tree dies next,
        and Slurm's SIGKILL may follow at once). A periodic one persists in RESUME, after the thaw:
        compressing and copying GiBs must not stretch the freeze."""
        st = self.state
        if self.ctx is None or st is None or st.epoch != epoch or not st.done or st.done[-1] is not capture.PREPARE[-1]:
            raise CaptureError("CAPTURE before PREPARE completed", epoch=epoch)
        st.final = final
        self._run(capture.CAPTURE_FINAL if final else capture.CAPTURE_PERIODIC, self.ctx, st)
        kind = st.record.tree.kind if st.record.tree else "image"
        return {"kind": kind, "bytes": st.record.bytes, "timings": st.timings,
                **({"persisting": True} if st.persister is not None else {})}

    def resume(self, epoch: int) -> dict[str, Any]:
        """After a periodic capture of every rank: RESUME's table. A persist failure leaves the epoch
        uncommitted and staging clean; the tree keeps running."""
        st, ctx = self.state, self.ctx
        if st is None or ctx is None:
            return {"bytes": 0, "raw_bytes": 0}
        persisted = st.persister is not None      # a final capture's images went to their persister
        dumped = st.dumped
        if st.done:
            st.done = []
            self._settled(settle([(s.name, s.run) for s in capture.RESUME_TREE], ctx, st), ctx, epoch)
        if dumped and not persisted:
            capture.RESUME[-1].run(ctx, st)
        return {"bytes": st.record.bytes, "raw_bytes": st.record.raw_bytes}

    def abort(self, epoch: int) -> None:
        """Undo this epoch; after the thaw (its persist done, the epoch failed elsewhere) its images go."""
        st, ctx = self.state, self.ctx
        if st is None or ctx is None:
            return
        resumed = not st.done
        self._rollback(ctx, st)
        if resumed:
            images.discard(ctx, epoch)

    def finish(self, epoch: int) -> None:
        """After COMMIT of a final capture: the tree dies (killed while frozen, so it runs no further).
        Every process of the cgroup, not only the root: one that left the tree's PID namespace (a
        setns'd helper) does not die with its init."""
        if self.ctx is not None:
            self.ctx.cgroup.kill_all()
        if self.state is not None:
            self.state.done = []
            if self.ctx is not None:
                capture.put_back_memory(self.ctx, self.state)

    # ---- the tree -----------------------------------------------------------------------------------------
    def started(self, ctx: RankContext) -> None:
        """The agent launched the tree whose context this is."""
        self.ctx, self.state = ctx, None

    def restore(self, ctx: RankContext, epoch: int, stdio: list[int]) -> tuple[int | None, RankRecord]:
        """Restore this rank from `epoch` with the new task's stdio fds (RESTORE's table): (root pid, or None
        for a replayed batch step; the rank manifest). On success the runner holds the restored tree."""
        self.ctx, st = ctx, RestoreState(epoch, stdio=stdio)
        self.state = st
        try:
            restore.run(ctx, st)
        finally:
            for fd in st.owned_fds:
                os.close(fd)
            if st.images is not None:
                ctx.policy.staging.remove(st.images)
        if st.pid is not None:
            self.ctx = restore.restored(ctx, st.pid)
        assert st.manifest is not None         # the table ran whole: `unpack` read it
        return st.pid, st.manifest

    def kill_tree(self, why: str, consequence: str) -> str:
        """The tree must not run on (a process the GPU rollback could not bring back has lost its GPU state;
        criu was interrupted and may have left its parasite in it): it is killed, still frozen where it was
        (the wrapper then leaves the job without an exit code, so no capture commits without this rank) and
        never captured again; the previous commit stays the one restored. Returns what to tell the user."""
        ctx = self.ctx
        self.killed_for = why
        extra = {"step": ctx.step, "rank": ctx.rank} if ctx else {}
        log.error("killing the task's tree: %s", why, extra=extra)
        try:
            if ctx is not None:
                ctx.cgroup.kill_all()
        except OSError as e:     # still never captured again: killed_for is set
            log.error("killing the task's tree failed: %s", e, extra=extra)
            return (f"killing the task failed ({e.strerror or e}): {consequence} and is never captured again; "
                    "cancel the job (scancel); the previous checkpoint stays the one restored (scontrol "
                    "requeue restores it)")
        return (f"the task was killed: {consequence}; the previous checkpoint stays the one restored "
                "(scontrol requeue restores it)")

    # ---- internals -------------------------------------------------------------------------------------
    def _require_tree(self) -> RankContext:
        ctx = self.ctx
        if self.killed_for:
            raise CaptureError(f"nothing to capture: the task's tree was killed ({self.killed_for})",
                               step=ctx.step if ctx else None, rank=ctx.rank if ctx else None)
        if ctx is None or not ctx.root_pid or not procfs.exists(ctx.root_pid):
            raise TaskEnded("no running task tree to capture", **({"step": ctx.step, "rank": ctx.rank} if ctx else {}))
        return ctx

    def _run(self, table: tuple[Stage, ...], ctx: RankContext, st: EpochState) -> None:
        def rolled_back(stage: str, error: BaseException) -> None:
            self.failed_stage = stage
            if isinstance(error, CriuInterrupted):
                # Stopped at its timeout or killed: a process may still hold criu's parasite code (or half of
                # a cure), which the rollback's thaw would run. Killed first, while frozen (criu/driver.py).
                self.kill_tree(f"criu was interrupted in the {stage} of epoch {st.epoch}",
                               "criu may have left its parasite code in it")
            try:
                self.abort(st.epoch)
            except CaptureError as undo:    # the first failure first: it is what the user needs to see
                raise CaptureError(f"stage {stage} failed: {error}; then {undo}", epoch=st.epoch) from error
            if not isinstance(error, SlurmckptError):
                raise CaptureError(f"stage {stage} failed: {error}", epoch=st.epoch) from error
        run_table(table, ctx, st, rolled_back)

    def _rollback(self, ctx: RankContext, st: EpochState) -> None:
        failures = settle(undo_steps(st.done), ctx, st)
        st.done = []
        self._settled(failures, ctx, st.epoch)

    def _settled(self, failures: list[Failure], ctx: RankContext, epoch: int) -> None:
        """A process the GPU rollback could not bring back (cuda.stage.GpuRollbackError: `stuck`) has lost
        its GPU state: the tree is killed. Any failure is raised, all of them named."""
        errors = [str(f) for f in failures]
        if any(getattr(f.error, "stuck", None) for f in failures) and not self.killed_for:
            errors.append(self.kill_tree(f"a process lost its GPU state in epoch {epoch}",
                                         "it cannot run on without its GPU state"))
        if errors:
            raise CaptureError("rollback incomplete: " + "; ".join(errors), epoch=epoch)
