"""The task's wrapper as the agent sees it: a pid held by a pidfd.

The agent is the wrapper's child; it serves that one process. The pid alone could name another process
once the wrapper exits (pids are reused), so the agent opens a pidfd on it at start (checking that the pid
is still its parent afterwards, which closes the race) and re-checks it before every request and after
every /proc read that names the pid.
"""
from __future__ import annotations

import os
import select
from dataclasses import dataclass

from slurmckpt.errors import PermissionDenied


@dataclass(frozen=True)
class Peer:
    pid: int
    pidfd: int

    @classmethod
    def parent(cls) -> "Peer":
        pid = os.getppid()
        pidfd = os.pidfd_open(pid)
        if os.getppid() != pid:        # the parent died before the pidfd was opened: it may be anybody now
            os.close(pidfd)
            raise PermissionDenied("the task's wrapper exited before its agent started", pid=pid)
        return cls(pid, pidfd)

    def alive(self) -> bool:
        """A pidfd becomes readable when its process exits."""
        return not select.select([self.pidfd], [], [], 0)[0]

    def require(self) -> int:
        """The wrapper's pid, valid for what the caller reads next; raises if the wrapper has exited."""
        if not self.alive():
            raise PermissionDenied("the task's wrapper has exited", pid=self.pid)
        return self.pid
