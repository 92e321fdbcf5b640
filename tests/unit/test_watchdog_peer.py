"""The thaw watchdog (thaws when the agent's pipe closes, and after a freeze that outlasts any capture) and
the pidfd-held wrapper (a peer that exited is refused)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from slurmckpt import watchdog
from slurmckpt.errors import PermissionDenied
from slurmckpt.identity import TreeName
from slurmckpt.task_cgroup import TaskCgroup
from slurmckpt.peer import Peer


def _v1_cgroup(tmp_path: Path, state: str) -> TaskCgroup:
    (tmp_path / "freezer.state").write_text(state)
    (tmp_path / "cgroup.procs").write_text("")
    return TaskCgroup(tmp_path, TreeName(1, "0", 0, 0))


def _thawed_within(freezer: TaskCgroup, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while freezer.state() != "THAWED" and time.monotonic() < deadline:
        time.sleep(0.05)
    return freezer.state() == "THAWED"


def test_watchdog_thaws_when_the_agent_is_gone(tmp_path: Path) -> None:
    freezer = _v1_cgroup(tmp_path, "FROZEN")
    r, w = os.pipe()
    t = threading.Thread(target=watchdog.watch, args=(freezer, r, 3600, 0.05))
    t.start()
    time.sleep(0.2)
    assert freezer.state() == "FROZEN", "a live agent's freeze is left alone"
    os.close(w)
    t.join(5)
    assert not t.is_alive() and freezer.state() == "THAWED"


def test_watchdog_thaws_a_freeze_that_outlasts_any_capture(tmp_path: Path) -> None:
    freezer = _v1_cgroup(tmp_path, "FROZEN")
    r, w = os.pipe()
    t = threading.Thread(target=watchdog.watch, args=(freezer, r, 0.3, 0.05), daemon=True)
    t.start()
    assert _thawed_within(freezer, 5)
    os.close(w)
    t.join(5)


def test_the_agent_can_lengthen_the_frozen_limit_for_a_large_epoch(tmp_path: Path) -> None:
    """A 0.3 s limit raised to an hour by the agent (an epoch with many GiB to dump) no longer thaws."""
    freezer = _v1_cgroup(tmp_path, "FROZEN")
    r, w = os.pipe()
    watchdog.set_limit(w, 3600)
    t = threading.Thread(target=watchdog.watch, args=(freezer, r, 0.3, 0.05), daemon=True)
    t.start()
    time.sleep(1.0)
    assert freezer.state() == "FROZEN"
    watchdog.set_limit(w, 0)                      # and back down: the freeze now outlasts it
    assert _thawed_within(freezer, 5)
    os.close(w)
    t.join(5)


def test_peer_that_exited_is_refused() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(0.3)
        os._exit(0)
    peer = Peer(pid, os.pidfd_open(pid))
    assert peer.alive() and peer.require() == pid
    os.waitpid(pid, 0)
    assert not peer.alive()
    with pytest.raises(PermissionDenied):
        peer.require()
