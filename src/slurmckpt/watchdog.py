"""The thaw watchdog: a root process next to the agent that never lets the task's tree stay frozen.

The freeze control is root's alone (the user could otherwise freeze its own tree and leave it so: Slurm
cannot kill a frozen tree and drains the node). The watchdog stands in for the agent where the agent
cannot act: it thaws the tree when the agent dies (kill -9, crash) and when the tree has been frozen
longer than any capture may take. It holds the read end of a pipe whose write end only the agent holds;
the agent writes `limit SECONDS` lines there when an epoch's sizes call for a longer limit (set_limit).
"""
from __future__ import annotations

import logging
import os
import select
import time

from slurmckpt.task_cgroup import TaskCgroup

log = logging.getLogger("slurmckpt.watchdog")


def start(cgroup: TaskCgroup, max_frozen_s: float, poll_s: float = 1.0) -> int:
    """Fork the watchdog; returns the write end the agent keeps open for as long as it lives."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(w)
        code = 0
        try:
            watch(cgroup, r, max_frozen_s, poll_s)
        except BaseException:  # noqa: BLE001 - a watchdog exits, it never returns into the agent's code
            code = 1
        os._exit(code)
    os.close(r)
    return w


def set_limit(agent_fd: int, max_frozen_s: float) -> None:
    """How long the tree may stay frozen from now on (an epoch whose bytes take longer than the default)."""
    os.write(agent_fd, f"limit {max_frozen_s:.0f}\n".encode())


def watch(cgroup: TaskCgroup, agent_fd: int, max_frozen_s: float, poll_s: float = 1.0) -> None:
    frozen_since: float | None = None
    pending = b""
    while True:
        ready, _, _ = select.select([agent_fd], [], [], poll_s)
        if ready:
            data = os.read(agent_fd, 256)
            if not data:
                _thaw(cgroup, "the agent is gone")
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                word, _, value = line.decode(errors="replace").partition(" ")
                if word == "limit" and value.isdigit():
                    max_frozen_s = float(value)
        try:
            frozen = cgroup.state() != "THAWED"
        except OSError:
            return                     # the cgroup was removed: the task is over
        now = time.monotonic()
        if not frozen:
            frozen_since = None
        elif frozen_since is None:
            frozen_since = now
        elif now - frozen_since > max_frozen_s:
            _thaw(cgroup, f"frozen for more than {max_frozen_s:.0f}s")
            frozen_since = None


def _thaw(cgroup: TaskCgroup, why: str) -> None:
    try:
        if cgroup.state() != "THAWED":
            cgroup.thaw()
            log.warning("watchdog thawed the tree: %s", why)
    except OSError:
        pass
