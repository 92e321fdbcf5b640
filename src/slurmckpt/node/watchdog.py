"""The thaw watchdog: a root process next to the agent that never lets the task's tree stay frozen.

The freeze control is root's alone (the user could otherwise freeze its own tree and leave it so: Slurm
cannot kill a frozen tree and drains the node). The watchdog stands in for the agent where the agent
cannot act: it thaws the tree when the agent dies (kill -9, crash), and removes its cgroup once the tree
has ended, and it thaws the tree when it has been frozen longer than any capture may take. It holds the read end of a pipe whose write end only the agent holds;
the agent writes `limit SECONDS` lines there when an epoch's sizes call for a longer limit (set_limit).
When the agent is gone it also puts back any memory limit the agent raised for a capture and did not put
back yet (its ledger: node/host_memory.py).
"""
from __future__ import annotations

import logging
import os
import select
import time

from pathlib import Path

from slurmckpt.node import host_memory
from slurmckpt.node.task_cgroup import TaskCgroup

log = logging.getLogger("slurmckpt.watchdog")


def start(cgroup: TaskCgroup, max_frozen_s: float, poll_s: float = 1.0, ledger: Path | None = None) -> int:
    """Fork the watchdog; returns the write end the agent keeps open for as long as it lives. `ledger`: the
    agent's record of memory limits it raised (None: it raises none)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _close_inherited(keep={r})
            watch(cgroup, r, max_frozen_s, poll_s, ledger)
        except BaseException:  # noqa: BLE001 - a watchdog exits, it never returns into the agent's code
            code = 1
        os._exit(code)
    os.close(r)
    return w


def _close_inherited(keep: set[int]) -> None:
    """Every fd the agent had, but stdio, `keep` and the log's: the watchdog may outlive the agent, and a copy
    of the agent's channel would hide the agent's death from the wrapper (no EOF), and so stall the epoch."""
    for handler in logging.getLogger().handlers:
        for held in (getattr(handler, "stream", None), getattr(handler, "socket", None)):
            try:
                keep.add(held.fileno())  # type: ignore[union-attr]  # None or fd-less: AttributeError below
            except (AttributeError, OSError, ValueError):
                pass
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass                                # the listing's own fd, already closed


def set_limit(agent_fd: int, max_frozen_s: float) -> None:
    """How long the tree may stay frozen from now on (an epoch whose bytes take longer than the default)."""
    os.write(agent_fd, f"limit {max_frozen_s:.0f}\n".encode())


def watch(cgroup: TaskCgroup, agent_fd: int, max_frozen_s: float, poll_s: float = 1.0,
          ledger: Path | None = None) -> None:
    frozen_since: float | None = None
    pending = b""
    while True:
        ready, _, _ = select.select([agent_fd], [], [], poll_s)
        if ready:
            data = os.read(agent_fd, 256)
            if not data:
                _thaw(cgroup, "the agent is gone")
                _put_back(ledger)
                _remove_once_empty(cgroup, poll_s)
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


def _put_back(ledger: Path | None) -> None:
    if ledger is None:
        return
    try:
        for line in host_memory.put_back_all(ledger):
            log.warning("watchdog: %s", line)
    except OSError as e:
        log.error("watchdog could not put back the memory limits raised for a capture: %s", e)


def _remove_once_empty(cgroup: TaskCgroup, poll_s: float) -> None:
    """What the agent's shutdown would have done: the tree's cgroup goes once its last process has ended
    (the tree may run on for long when only the agent died). Slurm's final SIGKILL may end this watchdog
    with the agent and the wrapper: slurmstepd then kills what is left of the tree and removes its cgroup
    as it reaps the wrapper (spank/tree_end.c), and the next start of the task removes any cgroup still
    left (rank/leftovers.py collect_task_cgroups)."""
    while cgroup.path.is_dir():
        if not cgroup.pids():
            cgroup.remove()
            return
        time.sleep(poll_s)


def _thaw(cgroup: TaskCgroup, why: str) -> None:
    try:
        if cgroup.state() != "THAWED":
            cgroup.thaw()
            log.warning("watchdog thawed the tree: %s", why)
    except OSError:
        pass
