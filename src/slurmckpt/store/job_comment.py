"""The one writer of slurmckpt's note on a job in Slurm (slurm/comment.py: the field, its text, scontrol).

Several agents of a job write it (the batch step's for notes, the committing one for checkpoints), so both
parts live in the job's root-only store (`comment.json`, under the store's lock) and every write sends the
whole line. Checkpoint updates reach slurmctld at most once a minute per agent (the newest one is sent when
the minute is over); notes go at once.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, ContextManager

from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.comment import (MAX_FIELD, PREFIX, Checkpoint, Read, Write, compose, foreign_part, one_line,
                                     scontrol_read, scontrol_write)
from slurmckpt.slurm.control import JobEnded
from slurmckpt.store.jobstore import JobStore, atomic_write_json

log = logging.getLogger("slurmckpt.comment")

STATE_FILE = "comment.json"
CHECKPOINT_EVERY_S = 60.0


class JobComment:
    """`note(text)` and `checkpoint(...)` for one job, from one agent."""

    def __init__(self, store: JobStore, job: int, field: str, write: Write | None = None,
                 read: Read | None = None, lock: Callable[[], ContextManager[object]] | None = None,
                 background: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from slurmckpt.store.instance import store_lock
        self.store, self.job, self.field = store, job, field
        self._write, self._read = write or scontrol_write, read or scontrol_read
        self.lock = lock or (lambda: store_lock(store))
        self.background, self.clock = background, clock
        self._sent_at = -CHECKPOINT_EVERY_S
        self._timer: threading.Timer | None = None
        self._mutex = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.field != "none"

    def note(self, job: int, text: str) -> str:
        """Set the note now (the caller runs it off its request path: fresh_start.FailureReporter). Returns
        the field that was set."""
        if not self.enabled:
            return "none"
        self._change(note=one_line(text.removeprefix(PREFIX).strip(), MAX_FIELD))
        return self._send()

    def checkpoint(self, epoch: int, at: float, size: int, final: bool = False) -> None:
        if not self.enabled:
            return
        self._change(checkpoint={"epoch": epoch, "at": at, "size": size})
        with self._mutex:
            wait = self._sent_at + CHECKPOINT_EVERY_S - self.clock()
            if final or wait <= 0:
                pass
            elif self._timer is None:       # later: the newest state then, whatever it is
                self._timer = threading.Timer(wait, self._send_now)
                self._timer.daemon = True
                self._timer.start()
                return
            else:
                return
        self._send_now()

    def text(self) -> str:
        state = self._state()
        cp = state.get("checkpoint")
        return compose(state.get("note"), Checkpoint(**cp) if cp else None)

    # ---- internals ----------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads((self.store.job_dir / STATE_FILE).read_text())
            return state
        except (OSError, ValueError):
            return {}

    def _change(self, **parts: object) -> None:
        with self.lock():
            atomic_write_json(self.store.job_dir / STATE_FILE, {**self._state(), **parts})

    def _send_now(self) -> None:
        with self._mutex:
            self._sent_at = self.clock()
            self._timer = None
        if self.background:     # off the agent's request path: slurmctld may be slow
            threading.Thread(target=self._send, name="job-comment", daemon=True).start()
        else:
            self._send()

    def flush(self) -> None:
        """A checkpoint update still waiting for its minute goes now (the agent is about to exit)."""
        with self._mutex:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            self._send()

    def _send(self) -> str:
        try:
            current = self._read(self.job).get(self.field, "")
        except SlurmckptError as e:
            log.warning("job %d: %s not read (%s); other tools' text in it may be lost", self.job, self.field, e)
            current = ""
        state = self._state()
        cp = state.get("checkpoint")
        text = compose(state.get("note"), Checkpoint(**cp) if cp else None, foreign_part(current))
        try:
            field = self._write(self.job, self.field, text)
        except JobEnded:
            # The last update races the job's end (the agent flushes as it exits): expected, and nothing is
            # lost that matters, the checkpoint store and `slurmckpt status` keep the same state.
            log.info("job %d ended before its %s took the last update; `slurmckpt status` has it",
                     self.job, self.field)
            return "none"
        except Exception as e:  # noqa: BLE001 - informs only; the job goes on either way
            log.error("could not set job %d's %s: %s", self.job, self.field, e)
            return "none"
        log.info("job %d %s set: %s", self.job, field, text)
        return field
