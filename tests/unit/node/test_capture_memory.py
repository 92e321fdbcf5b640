"""Host memory of a GPU capture (rank/fit.py, node/host_memory.py; docs/gpu.md, "Host memory of a GPU
capture"): the GPU copy, and the images' page cache where the agent's criu is charged to the same cgroup,
against every memory limit above the CUDA process (memory.high included), refused in SIZE naming the --mem
the job needs; and the site's raise of Slurm's limits for the capture, put back on every path: after the GPU
restore, on an abort, and by the thaw watchdog when the agent is gone. Fake /proc and cgroup trees."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cgroupfs import fake_rmdir
from slurmckpt.cuda.interface import GpuUse
from slurmckpt.identity import TreeName
from slurmckpt.node import host_memory, watchdog
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.rank.fit import Footprint
from test_gpu_footprint import A, GIB, Node

JOB = "/system.slice/n1_slurmstepd.scope/job_7"
TASK = f"0::{JOB}/step_0/user/task_0"
AGENT = f"0::{JOB}/step_0/slurm"               # where slurmstepd (and so the agent, pure v2) is


@pytest.fixture
def node(tmp_path: Path, monkeypatch):
    from slurmckpt.node import procfs
    n = Node(tmp_path)
    monkeypatch.setattr(host_memory, "_roots", lambda d: True)     # as root: Slurm's directories are root's
    with procfs.rooted(n.proc):
        yield n


def job_24g(node: Node, resident: int = 4 * GIB, high: str | None = None) -> None:
    """Slurm's job cgroup of `--mem=24G`; the task's own cgroups without a limit."""
    files = {"memory.max": str(24 * GIB), "memory.current": str(resident + GIB),
             "memory.stat": f"anon {resident}\nactive_file {GIB // 2}\ninactive_file {GIB // 2}"}
    if high is not None:
        files["memory.high"] = high
    node.limit(JOB.lstrip("/"), files)
    node.limit(f"{JOB}/step_0".lstrip("/"), {"memory.max": "max", "memory.high": "max"})


def footprint(node: Node, gpu: int, host: int = 3 * GIB, writer: int | None = 2, allowed: bool = False) -> Footprint:
    node.process(11, cgroup=TASK)
    node.process(2, cgroup=AGENT)
    levels = host_memory.levels(11, writer)
    return Footprint(host, GpuUse({11: {A: gpu}}), 500 * GIB, tuple(levels), None, allowed)


def test_16gib_on_the_gpu_under_mem_24g_is_refused_naming_the_mem_it_needs(node):
    """The GPU machine's case: the copy (16 GiB) fit in the room the old check saw (24 - 4 = 20 GiB), but
    criu's images (19 GiB more of page cache, charged to the same job cgroup through the agent) did not:
    the job ran 104 s instead of 25 s and committed nothing. Now SIZE refuses at once, naming --mem."""
    job_24g(node)
    fp = footprint(node, 16 * GIB)
    [level] = fp.levels
    assert (level.cgroup, level.limit, level.resident, level.writer_inside) == (JOB, 24 * GIB, 4 * GIB, True)
    [why] = fp.refusals()
    assert why.startswith("the job's memory limit cannot hold the capture: ask Slurm for --mem=39G or more")
    assert (f"Its memory cgroup {JOB} (limit 24.0 GiB) would need 39.0 GiB, 15.0 GiB more: the job's 4.0 GiB in use "
            "there, the GPU checkpoint's copy of 16.0 GiB") in why
    assert why.endswith("and the images' page cache of 19.0 GiB (slurmckpt's criu writes them from inside this "
                        "cgroup)")
    assert fp.reply()["cgroup_headroom"] == GIB         # 24 - 4 in use - 19 of images: room for the copies


def test_what_the_mem_it_names_holds_fits(node):
    job_24g(node)
    node.limit(JOB.lstrip("/"), {"memory.max": str(39 * GIB)})
    assert footprint(node, 16 * GIB).refusals() == []


def test_images_written_from_outside_the_cgroup_are_not_charged_to_it(node):
    job_24g(node)
    fp = footprint(node, 16 * GIB, writer=None)
    assert fp.refusals() == [] and not fp.levels[0].writer_inside


def test_memory_high_below_max_is_the_limit_that_counts(node):
    """memory.high throttles the whole cgroup past it (what made the job crawl): it is the limit."""
    job_24g(node, high=str(20 * GIB))
    [level] = footprint(node, GIB, writer=None).levels
    assert level.limit == 20 * GIB and level.files == ("memory.max", "memory.high")


def test_v1_limits_with_swap_raise_memsw_first(node):
    node.mounts(f"30 25 0:26 / {node.cg / 'memory'} rw,nosuid - cgroup cgroup rw,memory")
    node.process(11, cgroup="5:memory:/slurm/uid_1000/job_7/step_0/task_0")
    node.limit("memory/slurm/uid_1000/job_7", {"memory.limit_in_bytes": str(24 * GIB),
                                               "memory.memsw.limit_in_bytes": str(30 * GIB),
                                               "memory.usage_in_bytes": str(4 * GIB), "memory.stat": ""})
    [level] = host_memory.levels(11)
    assert level.files == ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
    assert (level.limit, level.resident, level.raisable) == (24 * GIB, 4 * GIB, True)


def test_only_slurms_own_levels_from_the_job_down_may_be_raised(node, monkeypatch):
    node.limit("system.slice", {"memory.max": str(900 * GIB), "memory.current": "0"})
    job_24g(node)
    node.process(11, cgroup=TASK)
    by_cgroup = {lv.cgroup: lv.raisable for lv in host_memory.levels(11)}
    assert by_cgroup == {JOB: True, "/system.slice": False}
    monkeypatch.setattr(host_memory, "_roots", lambda d: False)        # the job's user's own cgroup
    assert not any(lv.raisable for lv in host_memory.levels(11))


# ---- the raise ------------------------------------------------------------------------------------------------
def limit_of(node: Node) -> int:
    return int((node.cg / JOB.lstrip("/") / "memory.max").read_text())


def test_the_site_may_raise_the_jobs_limit_for_the_capture_instead_and_put_it_back(node, tmp_path):
    job_24g(node, high=str(24 * GIB))
    fp = footprint(node, 16 * GIB, allowed=True)
    assert fp.refusals() == [] and fp.raises == [(fp.levels[0], 35 * GIB)]
    assert "root raises its limit by that much for the capture" in fp.notes()[0]
    assert "cgroup" not in fp.reply()                  # each rank's raise covers its own copy
    ledger = host_memory.ledger_path(str(tmp_path / "run"), "7.0.0.0")
    raised = host_memory.raise_limits(fp.raises, ledger)
    d = node.cg / JOB.lstrip("/")
    assert limit_of(node) == 59 * GIB and (d / "memory.high").read_text() == str(59 * GIB)
    assert host_memory._read_ledger(ledger) == raised
    assert oct(ledger.parent.stat().st_mode & 0o777) == "0o700"
    assert host_memory.put_back(raised, ledger) == []
    assert limit_of(node) == 24 * GIB and (d / "memory.high").read_text() == str(24 * GIB)
    assert host_memory._read_ledger(ledger) == []


def test_two_ranks_raising_one_job_cgroup_each_take_back_their_own(node, tmp_path):
    job_24g(node)
    fp = footprint(node, 2 * GIB, allowed=True)
    level = fp.levels[0]
    first = host_memory.raise_limits([(level, 5 * GIB)], host_memory.ledger_path(str(tmp_path), "7.0.0.0"))
    second = host_memory.raise_limits([(level, 7 * GIB)], host_memory.ledger_path(str(tmp_path), "7.0.1.0"))
    assert limit_of(node) == 36 * GIB
    host_memory.put_back(first, host_memory.ledger_path(str(tmp_path), "7.0.0.0"))
    assert limit_of(node) == 31 * GIB
    host_memory.put_back(second, host_memory.ledger_path(str(tmp_path), "7.0.1.0"))
    assert limit_of(node) == 24 * GIB


def test_the_raise_always_goes_back_and_is_never_stacked(node, tmp_path):
    """Attack: a job that grabs host memory while its limit is raised (its CPU threads run during the GPU
    checkpoint) must not keep the raise, nor grow it capture after capture: the limit goes back to its own
    (the kernel then reclaims or OOM-kills, as over --mem at any time), said; a level with a raise not yet
    put back is not raised again."""
    job_24g(node)
    fp = footprint(node, 16 * GIB, allowed=True)
    ledger = host_memory.ledger_path(str(tmp_path), "7.0.0.0")
    raised = host_memory.raise_limits(fp.raises, ledger)
    assert host_memory.raise_limits(fp.raises, ledger) == [] and limit_of(node) == 59 * GIB   # not stacked
    d = node.cg / JOB.lstrip("/")
    (d / "memory.current").write_text(str(30 * GIB))             # grabbed while the limit was raised
    [over] = host_memory.put_back(raised, ledger)
    assert limit_of(node) == 24 * GIB and host_memory._read_ledger(ledger) == []
    assert f"memory cgroup {JOB}: the job holds" in over and "more than its own limit" in over


def test_a_cgroup_gone_with_the_job_has_nothing_to_put_back(node, tmp_path):
    job_24g(node)
    fp = footprint(node, 16 * GIB, allowed=True)
    ledger = host_memory.ledger_path(str(tmp_path), "7.0.0.0")
    raised = host_memory.raise_limits(fp.raises, ledger)
    for f in (node.cg / JOB.lstrip("/")).rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted((node.cg / JOB.lstrip("/")).rglob("*"), reverse=True):
        d.rmdir()
    (node.cg / JOB.lstrip("/")).rmdir()
    assert host_memory.put_back(raised, ledger) == [] and host_memory._read_ledger(ledger) == []


def test_a_ledger_directory_someone_else_could_write_is_refused(node, tmp_path):
    job_24g(node)
    fp = footprint(node, 16 * GIB, allowed=True)
    (tmp_path / "run" / "memory-raises").mkdir(parents=True, mode=0o777)
    os.chmod(tmp_path / "run" / "memory-raises", 0o777)
    with pytest.raises(PermissionError, match="not a private directory"):
        host_memory.raise_limits(fp.raises, host_memory.ledger_path(str(tmp_path / "run"), "7.0.0.0"))
    assert limit_of(node) == 24 * GIB


def test_the_watchdog_puts_the_limit_back_when_the_agent_dies_mid_capture(node, tmp_path, monkeypatch):
    """The agent raised the job's limit, then died (kill -9) before its RESUME: its watchdog, seeing the
    agent's pipe close, thaws the tree and puts the limit back from the ledger."""
    fake_rmdir(monkeypatch)
    job_24g(node)
    fp = footprint(node, 16 * GIB, allowed=True)
    ledger = host_memory.ledger_path(str(tmp_path / "run"), "7.0.0.0")
    host_memory.raise_limits(fp.raises, ledger)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "freezer.state").write_text("FROZEN")
    (tree / "cgroup.procs").write_text("")
    r, w = os.pipe()
    t = threading.Thread(target=watchdog.watch, args=(TaskCgroup(tree, TreeName(7, "0", 0, 0)), r, 3600, 0.05, ledger))
    t.start()
    time.sleep(0.2)
    assert limit_of(node) == 59 * GIB, "a live agent's raise is left alone"
    os.close(w)
    t.join(5)
    assert not t.is_alive() and limit_of(node) == 24 * GIB and not ledger.exists()
