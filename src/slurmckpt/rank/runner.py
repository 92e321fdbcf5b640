"""One rank, as the agent drives it: the phases the coordinator sends (SIZE, PREPARE, CAPTURE, RESUME, ABORT,
FINISH) and the restore, each a named table run by the engine (capture.py, restore.py) over the context the
agent built (context.py). What a phase may do is decided by where the epoch stands (its `Phase`); a failing
stage is rolled back by the engine. The runner keeps what outlives an epoch: the context of the tree it runs,
the current epoch's state, and why it killed the tree, if it did."""
from __future__ import annotations

import logging
import os
from typing import Any

from slurmckpt.errors import CaptureError, CriuInterrupted, SlurmckptError, TaskEnded
from slurmckpt.node import procfs, proctree
from slurmckpt.rank import capture, images, restore
from slurmckpt.rank.context import CaptureState, Phase, RankContext, RestoreState
from slurmckpt.rank.engine import Failure, Table, Unsettled, rollback, run_table
from slurmckpt.rank.fit import Footprint, measure as measure_footprint
from slurmckpt.store.record import RankRecord

log = logging.getLogger("slurmckpt.rank")


class RankRunner:
    def __init__(self) -> None:
        self.ctx: RankContext | None = None      # the running tree's; None until the agent built one
        self.state: CaptureState | None = None   # the current (or last) capture epoch's
        self.killed_for = ""                     # why this agent killed the tree (kill_tree)

    @property
    def failed_stage(self) -> str:
        """The stage that raised last (store/fresh_start.py records it; the coordinator's abort names it)."""
        return self.state.failed_stage if self.state else ""

    def stage_failed(self, stage: str) -> None:
        """The current epoch's `EpochState.stage_failed`; before the first epoch there is none to name."""
        if self.state is not None:
            self.state.stage_failed(stage)

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
        self.state = CaptureState(epoch)
        try:
            measured = measure_footprint(ctx.cgroup.pids(), ctx.gpu, ctx.store.job_dir,
                                         raise_allowed=ctx.limits.memory_ledger is not None)
            why = measured.refusals()
            if why:
                raise CaptureError("capture refused before anything was locked: " + "; ".join(why),
                                   step=ctx.step, rank=ctx.rank)
        except SlurmckptError:
            self.stage_failed("size")
            raise
        self.state.footprint = measured
        return {**measured.reply(), "notes": list(measured.gpu.notes) + measured.notes()}

    def prepare(self, epoch: int) -> dict[str, Any]:
        ctx = self._require_tree()
        sized = self.state.footprint if self.state and self.state.epoch == epoch else None
        st = self.state = CaptureState(epoch, footprint=sized,
                                       replay=ctx.step == "batch" and proctree.has_slurm_client(ctx.cgroup.pids()))
        self._run(capture.PREPARE, ctx, st)
        return {"timings": st.timings}

    def capture(self, epoch: int, final: bool = True) -> dict[str, Any]:
        """A final capture hands its staged images to a persister that outlives the job (the tree dies next,
        and Slurm's SIGKILL may follow at once). A periodic one persists in RESUME, after the thaw:
        compressing and copying GiBs must not stretch the freeze."""
        st = self.state
        if self.ctx is None or st is None or st.epoch != epoch or st.phase is not Phase.PREPARED:
            raise CaptureError("CAPTURE before PREPARE completed", epoch=epoch)
        st.final = final
        self._run(capture.FINAL_CAPTURE if final else capture.PERIODIC_CAPTURE, self.ctx, st)
        kind = st.record.tree.kind if st.record.tree else "image"
        return {"kind": kind, "bytes": st.record.bytes, "timings": st.timings,
                **({"persisting": True} if st.persister is not None else {})}

    def resume(self, epoch: int) -> dict[str, Any]:
        """After a periodic capture of every rank: RESUME's table gives the tree back, then PERSIST takes the
        staged images to the store (a final capture's went to their persister). A persist failure leaves
        the epoch uncommitted and staging clean; the tree keeps running."""
        st, ctx = self.state, self.ctx
        if st is None or ctx is None:
            return {"bytes": 0, "raw_bytes": 0}
        if st.holding:
            staged = st.phase is Phase.CAPTURED
            st.done = []         # given back: nothing of PREPARE or CAPTURE is undone any more
            try:
                run_table(capture.RESUME, ctx, st)
            except Unsettled as e:
                self._settled(e.failures, ctx, epoch)
            if staged:
                run_table(capture.PERSIST, ctx, st)
        return {"bytes": st.record.bytes, "raw_bytes": st.record.raw_bytes}

    def abort(self, epoch: int) -> None:
        """Undo this epoch: while it holds the tree, the undos of its stages done; once it no longer does
        (after the thaw, its persist done and the epoch failed elsewhere; or after its own rollback) its
        images go."""
        st, ctx = self.state, self.ctx
        if st is None or ctx is None:
            return
        held = st.holding
        self._settled(rollback(ctx, st), ctx, st.epoch)
        if not held:
            images.discard(ctx, epoch)

    def finish(self, epoch: int) -> None:
        """After COMMIT of a final capture: the tree dies (killed while frozen, so it runs no further).
        Every process of the cgroup, not only the root: one that left the tree's PID namespace (a
        setns'd helper) does not die with its init."""
        if self.ctx is not None:
            self.ctx.cgroup.kill_all()
        if self.state is not None:
            self.state.done = []
            self.state.phase = Phase.FINISHED
            if self.ctx is not None:
                capture.put_back_memory(self.ctx, self.state)

    # ---- the tree -----------------------------------------------------------------------------------------
    def started(self, ctx: RankContext) -> None:
        """The agent launched the tree whose context this is."""
        self.ctx, self.state = ctx, None

    def restore(self, ctx: RankContext, epoch: int, stdio: list[int]) -> tuple[int | None, RankRecord]:
        """Restore this rank from `epoch` with the new task's stdio fds (RESTORE's table): (root pid, or None
        for a replayed batch step; the rank manifest). On success the runner holds the restored tree."""
        self.ctx, self.state = ctx, None
        st = RestoreState(epoch, stdio=stdio)
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

    def _run(self, table: Table[CaptureState], ctx: RankContext, st: CaptureState) -> None:
        """`table` over the epoch; a failing stage is named and the engine rolls back what was done."""
        try:
            run_table(table, ctx, st)
        except Exception as error:  # an unexpected failure still rolls back
            stage = st.failed_stage      # named by the engine (EpochState.stage_failed)
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
            raise

    def _settled(self, failures: list[Failure], ctx: RankContext, epoch: int) -> None:
        """A process the GPU rollback could not bring back (cuda.stage.GpuRollbackError: `stuck`) has lost
        its GPU state: the tree is killed. Any failure is raised, all of them named."""
        errors = [str(f) for f in failures]
        if any(getattr(f.error, "stuck", None) for f in failures) and not self.killed_for:
            errors.append(self.kill_tree(f"a process lost its GPU state in epoch {epoch}",
                                         "it cannot run on without its GPU state"))
        if errors:
            raise CaptureError("rollback incomplete: " + "; ".join(errors), epoch=epoch)
