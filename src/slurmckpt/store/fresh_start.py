"""Why a job starts again from the beginning: never silently (docs/contracts.md, "Fresh starts").

The root side that sees a capture fail records it in the job's store (`capture-failures.json`, root-owned,
written by atomic rename under the store's lock, a fixed name in the job's directory): epoch, time, rank,
node, final or not, trigger, stage and the reason, one record per epoch (the first one that saw it: the
rank's own agent, before the coordinator's verdict relayed by the hosting wrapper). The previous commit is
untouched. When a requeued job's batch step finds nothing it can restore, its agent says why in one line
(`FailureReporter.fresh_start`): the wrapper prints it before the workload starts (Slurm truncated the output
file at the requeue) and the agent sets the job's AdminComment to it (Comment if that cannot be set).

Reasons carry what the job's user controls (paths, socket names, a wrapper's report), so every one is cut to
one line of printable characters and bounded (`one_line`) before it is stored, printed or sent to Slurm.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterator, Protocol

from slurmckpt import validate
from slurmckpt.errors import CriuError, StorageError, TaskEnded, is_retryable
from slurmckpt.store.instance import store_lock
from slurmckpt.slurm.comment import one_line
from slurmckpt.store.jobstore import JobStore, atomic_write_json

log = logging.getLogger("slurmckpt.fresh_start")

FAILURES_FILE = "capture-failures.json"
KEEP = 20                 # records kept per job (newest)
MAX_REASON = 400          # characters of one reason (one_line's default)
MAX_COMMENT = 700         # characters of the AdminComment line (slurm/comment.py)
MAX_ANNOTATIONS = 8       # AdminComment updates one agent makes at most (slurmctld is shared)

Annotate = Callable[[int, str], str]      # (job id, text) -> the field set (store/job_comment.py JobComment.note)


class StageTracker(Protocol):
    """What a rank's runner knows of its last failure (rank/runner.py RankRunner)."""
    @property
    def failed_stage(self) -> str: ...          # the stage that raised last

    def stage_failed(self, stage: str) -> None: ...


def reason_of(error: BaseException) -> str:
    """The reason an exception gives, as one line; for criu, its own last error line from the log tail."""
    if isinstance(error, CriuError):
        base = Exception.__str__(error)
        errors = [line for line in error.log_tail.splitlines() if "Error" in line]
        return one_line(f"{base}; criu: {errors[-1].strip()}" if errors else base)
    return one_line(str(error))


@dataclass(frozen=True)
class CaptureFailure:
    epoch: int
    at: float              # time.time() when it was recorded
    rank: str              # step.rank that failed ("" when the coordinator named none)
    node: str
    final: bool | None     # None: not known (the phase did not say)
    trigger: str           # interval, sigterm, walltime, manual, ...
    stage: str             # the rank's stage or the coordinator's phase that failed
    reason: str
    seen_by: str           # "agent" (the rank's own) or "coordinator" (relayed by the hosting wrapper)

    @property
    def kind(self) -> str:
        if self.final:
            return "final capture"
        if self.final is None:
            return "capture"
        return f"{self.trigger} capture" if self.trigger in ("interval", "manual") else "periodic capture"

    def describe(self) -> str:
        where = f" on rank {self.rank}" if self.rank else ""
        if self.stage == "window":       # decided before anything was frozen (agent/window.py)
            return f"the {self.kind} at epoch {self.epoch} was not taken{where}: {self.reason}"
        return f"the {self.kind} at epoch {self.epoch} failed{where}: {self.reason}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaptureFailure":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---- the record in the job's store -----------------------------------------------------------------------
def failures(store: JobStore) -> list[CaptureFailure]:
    """Recorded capture failures, newest epoch first; an unreadable record reads as none (it only informs)."""
    try:
        raw = json.loads((store.job_dir / FAILURES_FILE).read_text())
        found = [CaptureFailure.from_dict(d) for d in raw.get("failures", [])]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("%s of job %d unreadable: %s", FAILURES_FILE, store.job, e)
        return []
    return sorted(found, key=lambda f: (f.epoch, f.at), reverse=True)


def record(store: JobStore, failure: CaptureFailure) -> bool:
    """Add `failure` unless its epoch is recorded already. Returns whether it was added."""
    with store_lock(store):
        known = failures(store)
        if any(f.epoch == failure.epoch for f in known):
            return False
        kept = sorted([failure, *known], key=lambda f: (f.epoch, f.at))[-KEEP:]
        atomic_write_json(store.job_dir / FAILURES_FILE, {"version": 1, "failures": [asdict(f) for f in kept]})
        return True


def no_checkpoint_reason(store: JobStore, rank: str) -> str:
    """Why `rank` finds no committed epoch to restore, from what the store says."""
    try:
        manifest = store.read_manifest()
    except StorageError as e:
        return one_line(f"the job's checkpoint manifest is unreadable: {e}")
    if manifest.get("epochs"):
        return f"no committed checkpoint holds task {rank}"
    newest = next(iter(failures(store)), None)
    withdrawn = max(manifest.get("rejected", []), key=lambda r: r.get("epoch", 0), default=None)
    if withdrawn and (newest is None or withdrawn.get("epoch", 0) >= newest.epoch):
        return one_line(f"checkpoint epoch {withdrawn.get('epoch')} was withdrawn: {withdrawn.get('reason', '')}")
    if newest is None:
        return "no checkpoint committed yet"
    return newest.describe() if newest.final else f"no checkpoint committed yet; {newest.describe()}"


# ---- the agent's side ------------------------------------------------------------------------------------
class FailureReporter:
    """What one agent saw fail, recorded and told: capture failures (recorded; a final one also goes to the
    job's AdminComment), its restore failures of this run, and the fresh-start line."""

    def __init__(self, store: JobStore, job: int, rank: str, node: str, annotate: Annotate,
                 background: bool = True, on_recorded: Callable[[CaptureFailure], None] | None = None) -> None:
        self.store, self.job, self.rank, self.node = store, job, rank, node
        self.annotate = annotate
        self.on_recorded = on_recorded or (lambda failure: None)      # events.py: log line, metrics
        self.background = background
        self.restore_failures: list[tuple[int, str]] = []
        self.notice: str | None = None
        self.annotations = 0
        self.epoch: tuple[int, bool | None, str] = (0, None, "unknown")     # (epoch, final, trigger)
        self.sending: list[threading.Thread] = []                          # annotations on their way

    def epoch_began(self, epoch: int, final: bool | None, trigger: str) -> None:
        self.epoch = (epoch, final, trigger)

    def epoch_is_final(self, epoch: int, final: bool) -> None:
        if self.epoch[0] == epoch:
            self.epoch = (epoch, final, self.epoch[2])

    @contextmanager
    def recorded(self, epoch: int, phase: str, runner: StageTracker) -> Iterator[None]:
        """A capture phase run here that fails is recorded before the coordinator hears of it; a retryable
        one (a lock round the coordinator tries again) is not: its final verdict is recorded if it stands."""
        runner.stage_failed("")            # a stage of an earlier phase is not this one's
        try:
            yield
        except Exception as e:
            if is_retryable(e):
                log.info("%s of epoch %d: %s; the coordinator tries the round again", phase, epoch, e)
                raise
            _, final, trigger = self.epoch if self.epoch[0] == epoch else (epoch, None, "unknown")
            if isinstance(e, TaskEnded) and final is not True:   # a periodic capture raced the task's end
                log.info("%s of epoch %d: %s", phase, epoch, e)
                raise
            self.capture_failed(epoch, runner.failed_stage or phase, reason_of(e), final, trigger)
            raise

    def capture_failed(self, epoch: int, stage: str, reason: str, final: bool | None, trigger: str,
                       rank: str | None = None, node: str | None = None,
                       seen_by: str = "agent") -> CaptureFailure | None:
        failure = CaptureFailure(epoch, time.time(), one_line(self.rank if rank is None else rank, 32),
                                 one_line(self.node if node is None else node, 64), final, one_line(trigger, 64),
                                 one_line(stage, 64), one_line(reason), seen_by)
        try:
            added = record(self.store, failure)
        except OSError as e:
            log.error("could not record the failure of epoch %d: %s", epoch, e)
            return None
        log.warning("%s (recorded: %s)", failure.describe(), added)
        if added:
            self.on_recorded(failure)
        if added and final:
            self._annotate(f"slurmckpt: {failure.describe()}")
        return failure if added else None

    def restore_failed(self, epoch: int, error: BaseException) -> None:
        self.restore_failures.append((epoch, reason_of(error)))

    def failed_since(self, epoch: int) -> str | None:
        """For a task about to restore `epoch`: the newest failed capture if it is newer (what ran since
        `epoch` is lost), else None. A final capture's is said on the restore line (handover.requeue_cost)."""
        newest = next(iter(failures(self.store)), None)
        if newest is None or newest.epoch <= epoch or newest.final:
            return None
        return f"{newest.describe()}; restoring the older checkpoint epoch {epoch}"

    def fresh_start(self, restart_count: int, why_not: str | None) -> str:
        """The one line for a requeued task that starts from the beginning (computed once, annotated once).
        `why_not`: the agent's reason not to offer the store's images at all (instance binding), if any."""
        if self.notice is None:
            if self.restore_failures:
                reason = "; ".join(f"restore of checkpoint epoch {e} failed: {r}" for e, r in self.restore_failures)
            else:
                reason = why_not or no_checkpoint_reason(self.store, self.rank)
            reason = one_line(reason, MAX_COMMENT - 80)
            self.notice = f"starting from the beginning (restart {restart_count}): {reason}"
            self._annotate(f"slurmckpt: started from the beginning (restart {restart_count}): {reason}")
        return self.notice

    def _annotate(self, text: str) -> None:
        if self.annotations >= MAX_ANNOTATIONS:
            log.warning("not sent to Slurm (%d annotations already): %s", MAX_ANNOTATIONS, text)
            return
        self.annotations += 1
        text = one_line(text, MAX_COMMENT)

        def send() -> None:
            try:
                log.info("job %d %s set: %s", self.job, self.annotate(self.job, text), text)
            except Exception as e:  # noqa: BLE001 - informs only; the job goes on either way
                log.error("could not annotate job %d: %s", self.job, e)
        if self.background:     # off the op's path: slurmctld may be slow, the wrapper waits for the reply
            thread = threading.Thread(target=send, name="annotate", daemon=True)
            thread.start()
            self.sending.append(thread)
        else:
            send()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the annotations still on their way to slurmctld: the agent is about to exit, and a
        daemon thread dies with it. A failed final capture ends the program at once (its SIGTERM is passed
        on), so the agent exits right after it recorded the failure."""
        deadline = time.monotonic() + timeout_s
        for thread in self.sending:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.sending = [t for t in self.sending if t.is_alive()]


def coordinator_verdict(m: dict[str, Any]) -> dict[str, Any]:
    """The arguments of FailureReporter.capture_failed from a wrapper's report of its coordinator's aborted
    epoch (agent op capture_failed): every field checked (validate.py), text sanitized when recorded."""
    rank, node = m.get("rank"), m.get("node")
    return {"epoch": validate.epoch(m.get("epoch")), "stage": validate.label(m.get("stage", "unknown"), "stage"),
            "reason": validate.text(m.get("error", ""), "error"), "final": validate.flag(m.get("final"), "final"),
            "trigger": validate.label(m.get("trigger", "unknown"), "trigger"),
            "rank": "" if rank in (None, "?") else str(validate.rank_name(rank)),
            "node": "" if node in (None, "?") else validate.hostname(node), "seen_by": "coordinator"}
