"""Placement in Slurm's cgroup v2 task cgroup (TaskCgroup.placed_with_slurm) with a fake /proc and a fake
cgroup2 mount: which layouts are accepted as Slurm's, where the tree and the wrapper/agent go, that Slurm's
task cgroup is never removed by us, and that the job's other trees are found by label."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmckpt.rank.sharing import ipc
from slurmckpt.node import procfs
from slurmckpt.identity import TreeName
from slurmckpt.node.task_cgroup import LABEL, SlurmV2Placement, TaskCgroup, find_slurm_v2

STEP = "system.slice/node1_slurmstepd.scope/3f2a9c1e-sluid/step_0"     # no job_<id>: names are not read


def _proc(root: Path, pid: int, cgroup: str, ppid: int, uid: int) -> None:
    d = root / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(f"0::/{cgroup}\n")
    (d / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def _host(tmp_path: Path, task_cgroup: str = f"{STEP}/user/task_0", stepd_uid: int = 0) -> Path:
    """A pure v2 mount with Slurm's step layout; wrapper pid 100 in `task_cgroup`, its slurmstepd (50) in
    <step>/slurm, running as `stepd_uid`."""
    mount = tmp_path / "cg"
    (mount / "cgroup.controllers").parent.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    for d in (f"{STEP}/slurm", f"{STEP}/user/task_0", f"{STEP}/user/task_1"):
        (mount / d).mkdir(parents=True, exist_ok=True)
        (mount / d / "cgroup.procs").write_text("")
    (mount / task_cgroup).mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(f"30 25 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n")
    _proc(tmp_path, 100, task_cgroup, 50, 1000)
    _proc(tmp_path, 50, f"{STEP}/slurm", 1, stepd_uid)
    return mount


@pytest.fixture(autouse=True)
def fake_proc(tmp_path: Path):
    """procfs.py reads the fake /proc of these tests."""
    with procfs.rooted(tmp_path / "proc"):
        yield


@pytest.fixture
def xattrs(monkeypatch: pytest.MonkeyPatch) -> dict:
    """trusted.* xattrs need root and a file system that has them: kept in a dict instead."""
    store: dict = {}

    def getx(path, name):
        try:
            return store[(str(path), name)]
        except KeyError:
            raise OSError(61, "No data available") from None

    monkeypatch.setattr(os, "setxattr", lambda path, name, value: store.__setitem__((str(path), name), value))
    monkeypatch.setattr(os, "getxattr", getx)
    return store


@pytest.mark.system
def test_slurm_task_cgroup_is_found_without_reading_names(tmp_path: Path) -> None:
    """The wrapper's task cgroup and slurmstepd's cgroup are found from /proc by shape, whatever the job
    cgroup is called (Slurm 26.05 names it by SLUID)."""
    mount = _host(tmp_path)
    placed = find_slurm_v2(100, mount)
    assert placed == SlurmV2Placement(mount / STEP / "user/task_0", mount / STEP / "slurm")


@pytest.mark.parametrize("task_cgroup,stepd_uid,why", [
    (f"{STEP}/user/task_0/mine", 0, "a cgroup the user made below the task cgroup"),
    (f"{STEP}/user", 0, "the step's user cgroup itself"),
    (f"{STEP}/user/task_0", 1000, "a parent that is not root (not slurmstepd)"),
    ("user.slice/user-1000.slice/session-1.scope", 0, "a cgroup outside Slurm's step"),
])
def test_cgroups_not_shaped_like_slurms_task_cgroup_are_refused(tmp_path: Path, task_cgroup: str,
                                                                 stepd_uid: int, why: str) -> None:
    """Only <step>/user/<task> next to a root slurmstepd's <step>/slurm is taken as Slurm's task cgroup."""
    mount = _host(tmp_path, task_cgroup, stepd_uid)
    assert find_slurm_v2(100, mount) is None, why


@pytest.mark.system
def test_pure_v2_tree_goes_into_slurms_task_cgroup_and_helpers_into_slurmstepds(tmp_path: Path,
                                                                               xattrs: dict) -> None:
    """On pure v2 the freeze cgroup becomes Slurm's task cgroup itself (Slurm lists, signals, limits and
    accounts its pids); the wrapper and the agent are moved to slurmstepd's cgroup, the task cgroup is
    labelled with the tree's name, and remove() thaws it but never rmdirs it (Slurm does)."""
    mount = _host(tmp_path)
    own = mount / "slurmckpt" / "7.0.0.1"
    own.mkdir(parents=True)
    placed = TaskCgroup(own, TreeName(7, "0", 0, 1)).placed_with_slurm(100)
    task = mount / STEP / "user/task_0"
    assert (placed.path, str(placed.tree), placed.owned, placed.slurm_procs) == (task, "7.0.0.1", False, ())
    placed.move_helpers([100])
    assert (mount / STEP / "slurm/cgroup.procs").read_text() == "100"
    assert xattrs[(str(task), LABEL)] == b"7.0.0.1"
    (task / "cgroup.freeze").write_text("1")
    placed.remove()
    assert task.is_dir() and (task / "cgroup.freeze").read_text() == "0"
    assert placed.placed_with_slurm(100) is placed, "placed once"


def test_without_a_slurm_task_cgroup_the_tree_keeps_its_own_cgroup(tmp_path: Path) -> None:
    """proctrack/linuxproc + task/none on pure v2: no Slurm task cgroup, our own freeze cgroup stays."""
    mount = _host(tmp_path, "system.slice/slurmd.service")
    own = mount / "slurmckpt" / "7.0.0.0"
    own.mkdir(parents=True)
    placed = TaskCgroup(own, TreeName(7, "0", 0, 0)).placed_with_slurm(100)
    assert placed.path == own and placed.owned and placed.helpers is None


def test_the_jobs_other_trees_are_found_by_label(tmp_path: Path, xattrs: dict) -> None:
    """The capture's IPC checks see the job's other labelled task cgroups on the node, named by label."""
    mount = _host(tmp_path)
    t0, t1 = mount / STEP / "user/task_0", mount / STEP / "user/task_1"
    (t0 / "cgroup.procs").write_text("11\n")
    (t1 / "cgroup.procs").write_text("21\n22\n")
    xattrs[(str(t1), LABEL)] = b"7.0.1.0"
    xattrs[(str(mount / STEP / "user/task_1x"), LABEL)] = b"not a tree name"
    mine = TaskCgroup(t0, TreeName(7, "0", 0, 0), owned=False)
    assert {pid: str(t) for pid, t in ipc.job_trees(mine.other_trees(), 7).items()} == {21: "7.0.1.0", 22: "7.0.1.0"}


@pytest.mark.parametrize("path,ok", [
    ("/slurm/uid_1000/job_7/step_batch/task_0", True),
    ("/slurm/uid_1000/job_7/step_0", True),
    ("/slurm_node1/uid_1000/3f2a9c1e-sluid/step_0/task_1", True),     # 26.05: the job is named by SLUID
    ("/slurm/uid_1000/job_8/step_0/task_0", False),                   # another job
    ("/slurm/uid_1000/job_7", False),                                 # no step
    ("/user.slice/user-1000.slice", False),
    ("/", False),
])
def test_slurm_cgroups_of_the_job_are_recognised_by_job_id_or_step_shape(path: str, ok: bool) -> None:
    """v1/hybrid: the task's cgroups that the tree joins are the job's own step cgroups, named by job id or
    (Slurm 26.05) by SLUID with the step below it; nothing outside a step of this job."""
    from slurmckpt.node.task_cgroup import _slurm_step_path
    assert _slurm_step_path(path, 7) is ok
