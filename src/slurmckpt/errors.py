"""One exception tree; every error carries the context needed to act on it."""
from __future__ import annotations


class SlurmckptError(Exception):
    """Base of every slurmckpt error. `context` holds job/step/rank/pid/stage where known.

    `retryable`: the same operation may succeed if tried again. Only LockContended, ExchangeInFlight and
    EpochGone set it; a lock round (coordinator/server.py, barrier/rounds.py) retries on those, with a
    new epoch, and on nothing else."""

    retryable = False

    def __init__(self, message: str, **context: object) -> None:
        self.context = {k: v for k, v in context.items() if v is not None}
        detail = " ".join(f"{k}={v}" for k, v in self.context.items())
        super().__init__(f"{message} [{detail}]" if detail else message)


def is_retryable(exc: BaseException) -> bool:
    """Whether `exc` is typed retryable (LockContended, ExchangeInFlight, EpochGone); never decided from its
    text."""
    return isinstance(exc, SlurmckptError) and exc.retryable


class ConfigError(SlurmckptError):
    """Bad configuration value; the message names the key."""


class ProtocolError(SlurmckptError):
    """Malformed, oversized, unauthenticated or unexpected message."""


class PermissionDenied(SlurmckptError):
    """A request outside what the requester may do (other job, other user, foreign pid)."""


class LockContended(SlurmckptError):
    """A lock could not be taken within its timeout because work was still in flight (a GPU kernel inside a
    collective whose peer is already locked): every rank unlocks, and the lock round is tried again."""

    retryable = True


class CaptureError(SlurmckptError):
    """A capture stage failed; the previous commit stays valid."""


class TaskEnded(CaptureError):
    """The task's tree has ended (its program exited, its rank is leaving the job): a periodic capture that
    raced that end has nothing to capture here, and the next one goes on without the rank. Not news to the
    user, unlike every other aborted capture."""


class WindowTooShort(CaptureError):
    """A final capture would not end before Slurm's SIGKILL (KillWait, GraceTime + KillWait for a preemption),
    judged before anything is frozen: none is taken, the last commit stays the one restored, and the job's
    output, its AdminComment and slurmd's log say what it would have needed (agent/window.py)."""


class ExchangeInFlight(CaptureError):
    """The frozen tree is inside a request/answer exchange with a process the restore replaces (slurmstepd's
    PMI server has read a rank's request and not answered yet): captured now, the restored rank would wait
    forever for an answer the next step never got the request for. Every rank thaws and the lock round is
    tried again: most exchanges end in milliseconds, a barrier only when every rank has reached it."""

    retryable = True


class RestoreError(SlurmckptError):
    """A restore failed; the caller falls back to an older epoch or a fresh run."""


class CriuError(SlurmckptError):
    """criu exited non-zero; `log_tail` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "", **context: object) -> None:
        super().__init__(message, **context)
        self.log_tail = log_tail

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n--- criu log tail ---\n{self.log_tail}" if self.log_tail else base


class CriuInterrupted(CriuError):
    """criu did not end through its own error path: it ran past its timeout, or a signal ended it. What it
    left cannot be trusted: a dumped tree may still hold its parasite code (or be half-cured), a restore
    may have left half-restored processes; the caller kills the tree (rank/runner.py, rank/restore.py)."""


class StorageError(SlurmckptError):
    """Image store problem: missing, corrupt (checksum) or incomplete checkpoint."""


class EpochGone(StorageError):
    """The epoch's directory is gone while this rank prepared it: another rank's abort withdrew it (the last
    rank's images went, and the directory with them) or gc collected it after its lease ran out. Nothing of
    this rank is lost, and the coordinator's next round allocates a new epoch: retryable, not news."""
    retryable = True


class SlurmError(SlurmckptError):
    """A Slurm command failed."""


class GpuError(SlurmckptError):
    """CUDA checkpoint API failure or unsupported GPU configuration."""
