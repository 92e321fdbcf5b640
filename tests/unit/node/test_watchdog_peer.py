"""The thaw watchdog (thaws when the agent's pipe closes, and after a freeze that outlasts any capture) and
the pidfd-held wrapper (a peer that exited is refused)."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from slurmckpt.rank import leftovers
from slurmckpt.node import watchdog
from slurmckpt.errors import PermissionDenied
from slurmckpt.identity import TreeName
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.node.peer import Peer
from cgroupfs import fake_rmdir


def _v1_cgroup(tmp_path: Path, state: str) -> TaskCgroup:
    (tmp_path / "freezer.state").write_text(state)
    (tmp_path / "cgroup.procs").write_text("")
    return TaskCgroup(tmp_path, TreeName(1, "0", 0, 0))


def _thawed_within(freezer: TaskCgroup, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while freezer.state() != "THAWED" and time.monotonic() < deadline:
        time.sleep(0.05)
    return freezer.state() == "THAWED"


def test_watchdog_thaws_when_the_agent_is_gone(tmp_path: Path, cgroupfs_rmdir: list) -> None:
    freezer = _v1_cgroup(tmp_path, "FROZEN")
    r, w = os.pipe()
    t = threading.Thread(target=watchdog.watch, args=(freezer, r, 3600, 0.05))
    t.start()
    time.sleep(0.2)
    assert freezer.state() == "FROZEN", "a live agent's freeze is left alone"
    os.close(w)
    t.join(5)
    assert not t.is_alive() and cgroupfs_rmdir == [f"{tmp_path.name} THAWED"]


@pytest.fixture(autouse=True)
def cgroupfs_rmdir(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """(the watchdog removes what it watched once its agent is gone)"""
    return fake_rmdir(monkeypatch)


def test_watchdog_removes_the_cgroup_once_the_tree_left_by_its_agent_has_ended(tmp_path: Path,
                                                                               cgroupfs_rmdir: list) -> None:
    """Agent gone while the tree runs on: the tree is thawed and keeps its cgroup until its last process has
    ended; then the cgroup is removed and the watchdog ends."""
    path = tmp_path / "7.0.1.0"
    path.mkdir()
    freezer = _v1_cgroup(path, "FROZEN")
    (path / "cgroup.procs").write_text("4242\n")
    r, w = os.pipe()
    t = threading.Thread(target=watchdog.watch, args=(freezer, r, 3600, 0.05), daemon=True)
    t.start()
    os.close(w)
    assert _thawed_within(freezer, 5)
    time.sleep(0.3)
    assert path.is_dir() and t.is_alive(), "a cgroup that still holds the tree stays"
    (path / "cgroup.procs").write_text("")
    t.join(5)
    assert not t.is_alive() and cgroupfs_rmdir == ["7.0.1.0 THAWED"]


def test_the_watchdog_holds_none_of_the_agents_fds_so_the_wrapper_sees_the_agent_die(tmp_path: Path) -> None:
    """The watchdog (a fork of the agent) outlives it while the tree runs on: a copy of the agent's channel in
    it would keep the wrapper from ever reading EOF, and the epoch would wait for the dead agent."""
    path = tmp_path / "7.0.1.0"
    path.mkdir()
    freezer = _v1_cgroup(path, "THAWED")
    (path / "cgroup.procs").write_text("4242\n")             # the tree runs on: the watchdog stays
    agent_end, wrapper_end = socket.socketpair()
    w = watchdog.start(freezer, 3600, 0.05)
    try:
        agent_end.close()                                     # the agent dies
        wrapper_end.settimeout(5)
        assert wrapper_end.recv(1) == b"", "EOF for the wrapper"
    finally:
        os.close(w)
        (path / "cgroup.procs").write_text("")                # the tree ends: the watchdog removes it, exits
        deadline = time.monotonic() + 5
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        wrapper_end.close()
    assert not path.exists()


def test_an_agent_start_removes_only_its_own_tasks_empty_cgroups_of_earlier_starts(tmp_path: Path,
                                                                                   cgroupfs_rmdir: list) -> None:
    """Left by a start whose agent and watchdog were both killed: the same task's earlier, empty cgroups go
    (a frozen one too); one still holding a process, the current start's, other ranks', other jobs' and
    foreign names stay."""
    for name, procs, state in [("7.0.1.0", "", "FROZEN"), ("7.0.1.1", "", "THAWED"), ("7.0.1.2", "", "THAWED"),
                               ("7.0.1.3", "", "THAWED"), ("7.0.2.0", "", "THAWED"), ("17.0.1.0", "", "THAWED"),
                               ("7.batch.1.0", "", "THAWED"), ("7.0.1.x", "", "THAWED")]:
        (tmp_path / name).mkdir()
        _v1_cgroup(tmp_path / name, state)
        (tmp_path / name / "cgroup.procs").write_text(procs)
    (tmp_path / "7.0.1.1" / "cgroup.procs").write_text("99\n")
    found = leftovers.collect_task_cgroups(str(tmp_path), TreeName(7, "0", 1, 2))
    assert cgroupfs_rmdir == ["7.0.1.0 THAWED"]
    assert {(Path(r.path).name, r.kind) for r in found} == {("7.0.1.0", "task-cgroup"), ("7.0.1.1", "kept")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["17.0.1.0", "7.0.1.1", "7.0.1.2", "7.0.1.3", "7.0.1.x",
                                                          "7.0.2.0", "7.batch.1.0"]


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
