"""What the parts of the wrapper share (task/wrapper.py builds it; task/start.py and task/epochs.py use it):
its state, declared once, and the operations each part calls on the whole."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmckpt.config import Config
    from slurmckpt.slurm.env import TaskEnv
    from slurmckpt.task.membership import Membership
    from slurmckpt.task.schedule import Schedule
    from slurmckpt.task.srun_relay import SrunRelay


class WrapperParts:
    env: TaskEnv
    argv: list[str]
    config: Config
    member: Membership
    schedule: Schedule | None
    srun_relay: SrunRelay | None
    root_pid: int | None
    pmi_fd: int | None
    gate: threading.Event                  # replayed batch output passes once a step resumes
    final_capture: threading.Event         # criu ends the tree itself in a final capture
    final_committed: threading.Event
    awaiting_requeue: bool
    fresh_notice: str | None
    completed_code: int | None = None      # the task had finished before the capture: its exit code
    noted: set[str]
    capture_timeout_s: float
    choice_lock: threading.Lock
    choice_pending: dict[str, Any] | None
    choice_recorder: bool

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict[str, Any]:
        raise NotImplementedError

    def _say(self, text: str) -> None:
        raise NotImplementedError

    def _launch(self, relay: bool) -> None:
        raise NotImplementedError

    def _started(self, action: str) -> None:
        raise NotImplementedError

    def _requeue(self) -> None:
        raise NotImplementedError

    def _pass_sigterm_on(self, grace_s: float = 10.0) -> None:
        raise NotImplementedError
