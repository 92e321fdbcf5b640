"""The rank engine's stage order and rollback, with a fake task cgroup / CRIU engine / GPU stage."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slurmckpt.cuda.stage import GpuRollbackError
from slurmckpt.errors import CaptureError, CriuError, CriuInterrupted, GpuError, TaskEnded
from slurmckpt.cuda.interface import GpuUse
from slurmckpt.identity import TreeName
from slurmckpt.node.launch import Credentials
from dataclasses import replace

from slurmckpt.identity import RankName
from slurmckpt.node.packet_filter import Iptables
from slurmckpt.rank.capture import FINAL_CAPTURE, PERIODIC_CAPTURE, PERSIST, PREPARE, RESUME
from slurmckpt.rank.context import Limits, RankContext
from slurmckpt.rank.runner import RankRunner
from slurmckpt.store.compression import Zstd
from slurmckpt.store.persist import Priority
from slurmckpt.rank.images import StorePolicy
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from slurmckpt.store.record import Capture, Gpu
from store_harness import InProcess


@dataclass
class Journal:
    events: list[str] = field(default_factory=list)


@dataclass
class FakeCgroup:
    journal: Journal
    path: Path = Path("/nonexistent")
    frozen: bool = False
    tree: TreeName = TreeName(7, "batch", 0, 0)

    members: list[int] | None = None          # processes a (fake) restore put in the cgroup

    def pids(self) -> list[int]:
        if self.members is None:
            return [os.getpid()]
        return [pid for pid in self.members if _running(pid)]

    def other_trees(self) -> dict:
        return {}

    def kill_all(self) -> None:
        self.journal.events.append("kill")
        for pid in self.pids():
            os.kill(pid, 9)

    def add(self, pid: int) -> None:
        pass

    def freeze(self) -> float:
        self.journal.events.append("freeze")
        self.frozen = True
        return 0.0

    def thaw(self) -> None:
        self.journal.events.append("thaw")
        self.frozen = False

    def state(self) -> str:
        return "FROZEN" if self.frozen else "THAWED"


def _wait_for_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 5
    while open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][:1] != state:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {state}"
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@dataclass
class FakeGpu:
    journal: Journal
    fail: str = ""
    use: GpuUse = field(default_factory=GpuUse)
    stops: bool = False                   # a tree with CUDA processes: criu leaves it stopped

    def _do(self, what: str):
        self.journal.events.append(what)
        if what == self.fail:
            raise GpuError(f"injected {what} failure")

    refused: tuple[str, ...] = ()         # what the check stage's GPU view refuses

    def refusals(self, pids): return list(self.refused)
    def footprint(self, pids): return self.use
    def check_restore(self, record): self._do("gpu-check-restore")
    def lock(self, pids): self._do("gpu-lock")
    def unlock(self): self._do("gpu-unlock")
    def checkpoint(self): self._do("gpu-checkpoint"); return {"processes": []}
    def resume(self): self._do("gpu-resume")
    def stops_for_resume(self): return self.stops
    def left_stopped(self, pids): self.journal.events.append(f"left-stopped {pids}")
    def restore(self, record, pids): self._do("gpu-restore")


@dataclass
class FakeEngine:
    journal: Journal
    fail: bool = False
    ghost_limit: int = -1
    failure: type[CriuError] = CriuError
    tree: list[int] = field(default_factory=list)      # the processes a dump leaves stopped (leave_stopped)

    def dump(self, pid, images, *, leave_running, freezer, ghost_limit=0, external=None, link_remap=False,
             mntns=False, inherited_devices=(), leave_stopped=False, skip_pages=()):
        self.journal.events.append("dump --leave-stopped" if leave_stopped else "dump")
        for stopped_pid in (self.tree if leave_stopped else []):      # what criu does to the tree it dumped
            os.kill(stopped_pid, signal.SIGSTOP)
            _wait_for_state(stopped_pid, "T")
        self.ghost_limit = ghost_limit
        if self.fail:
            raise self.failure("injected criu failure")
        (images / "pages-1.img").write_bytes(b"x" * 100)
        return 0.01


def make(tmp_path: Path, gpu_fail: str = "", criu_fail: bool = False, ghost_cap: int = 256 << 20):
    j = Journal()
    store = JobStore(tmp_path, "c", 7)
    store.ensure()
    creds = Credentials(os.getuid(), os.getgid(), (), ())
    policy = StorePolicy(Staging(tmp_path / "staging"), Zstd(1, 1), Priority(),
                         spawn=InProcess(store, Staging(tmp_path / "staging")))
    p = RankRunner()
    p.started(RankContext(store, RankName("batch", 0), FakeCgroup(j), FakeEngine(j, criu_fail), FakeGpu(j, gpu_fail),
                          creds, policy, Iptables(), os.getpid(), limits=Limits(ghost_limit_max=ghost_cap),
                          root_pid=os.getpid()))
    return p, j, store


def rooted(p: RankRunner, pid: int | None) -> None:
    """The agent's context for a tree whose root is `pid` (None: none yet, as before a restore)."""
    p.ctx = replace(p.ctx, root_pid=pid)


def test_stage_order_is_gpu_before_freeze_and_dump_last() -> None:
    assert PREPARE.names == ("check", "pmi-precheck", "space", "memory", "gpu-lock", "gpu-checkpoint", "freeze",
                             "pmi-idle", "drain-output")
    assert PERIODIC_CAPTURE.names == ("record", "host-copy", "dump", "snapshot-output")
    assert FINAL_CAPTURE.names == ("record", "host-copy", "dump", "snapshot-output", "handover")
    assert RESUME.names == ("thaw", "gpu-restore", "gpu-unlock", "memory") and RESUME.settled
    assert PERSIST.names == ("persist",)


@pytest.mark.system
def test_periodic_capture_then_resume_thaws_and_restores_gpus(tmp_path: Path) -> None:
    p, j, store = make(tmp_path)
    p.prepare(1)
    assert p.capture(1, final=False)["kind"] == "image"
    out = p.resume(1)
    assert 0 < out["bytes"] < 100        # 100 bytes of "x", compressed
    assert store.read_rank_manifest(1, "batch", 0).seal.files["pages-1.img"]["raw_size"] == 100
    assert j.events == ["gpu-lock", "gpu-checkpoint", "freeze", "dump", "thaw", "gpu-resume", "gpu-unlock"]
    assert store.verify_rank(1, "batch", 0).capture.tree.kind == "image"


def test_criu_failure_rolls_back_everything_and_discards_images(tmp_path: Path) -> None:
    p, j, store = make(tmp_path, criu_fail=True)
    p.prepare(1)
    with pytest.raises(CriuError):
        p.capture(1)
    assert j.events[-3:] == ["thaw", "gpu-resume", "gpu-unlock"]
    assert not store.rank_dir(1, "batch", 0).exists()
    assert p.ctx.cgroup.state() == "THAWED" and "kill" not in j.events and not p.killed_for


@pytest.mark.parametrize("final", [False, True])
def test_an_interrupted_criu_dump_gets_the_tree_killed_before_it_is_thawed(tmp_path: Path, final: bool) -> None:
    """criu was stopped at its timeout (or killed): a process may hold its parasite code, which a thaw would
    run. The tree is killed while still frozen, before the rollback thaws the cgroup; the epoch's images go,
    the task says why it was killed, and the rank is never captured again (the previous commit stays)."""
    p, j, store = make(tmp_path, criu_fail=True)
    p.ctx.criu.failure = CriuInterrupted
    child = subprocess.Popen(["sleep", "60"])
    p.ctx.cgroup.members = [child.pid]
    rooted(p, child.pid)
    p.prepare(1)
    with pytest.raises(CriuInterrupted):
        p.capture(1, final=final)
    assert child.wait(5) == -9
    assert j.events[j.events.index("dump"):] == ["dump", "kill", "thaw", "gpu-resume", "gpu-unlock"]
    assert p.killed_for == "criu was interrupted in the dump of epoch 1"
    assert not store.rank_dir(1, "batch", 0).exists()
    with pytest.raises(CaptureError, match="nothing to capture: the task's tree was killed"):
        p.prepare(2)


def test_a_failure_whose_undo_fails_too_is_reported_with_both(tmp_path: Path) -> None:
    """The dump fails and the GPU restore of the undo fails as well: the error names the dump's failure first,
    then what could not be undone."""
    p, j, _ = make(tmp_path, gpu_fail="gpu-resume", criu_fail=True)
    p.prepare(1)
    with pytest.raises(CaptureError) as e:
        p.capture(1)
    assert str(e.value).startswith("stage dump failed: injected criu failure; then rollback incomplete: ")
    assert "injected gpu-resume failure" in str(e.value) and p.failed_stage == "dump"


@pytest.mark.system
def test_a_process_left_without_its_gpu_state_gets_its_tree_killed_and_never_captured_again(
        tmp_path: Path) -> None:
    """The GPU restore after a periodic dump fails and its rollback leaves a process without GPU state: the
    tree is killed (run on, it would crash or a later capture would commit it), the error says so, and every
    later capture of this rank is refused."""
    p, j, _ = make(tmp_path)
    child = subprocess.Popen(["sleep", "60"])
    p.ctx.cgroup.members = [child.pid]
    rooted(p, child.pid)

    def lost() -> None:
        j.events.append("gpu-resume")
        raise GpuRollbackError("GPU rollback failed", {child.pid: "NO_CUDA"})
    p.ctx.gpu.resume = lost
    p.prepare(1)
    p.capture(1, final=False)
    with pytest.raises(CaptureError) as e:
        p.resume(1)
    assert child.wait(5) == -9
    assert "(its GPU state is lost)" in str(e.value) and "the task was killed" in str(e.value)
    assert p.killed_for == "a process lost its GPU state in epoch 1"
    with pytest.raises(CaptureError, match="nothing to capture: the task's tree was killed") as e:
        p.prepare(2)
    assert not isinstance(e.value, TaskEnded)       # a killed tree is news to the user, unlike an ended one


@pytest.mark.system
def test_a_tree_without_gpu_state_that_cannot_be_killed_is_named_so_and_never_captured_again(
        tmp_path: Path) -> None:
    """The kill of such a tree fails itself (the cgroup's kill file cannot be written): the rollback's error
    says that the kill failed and what to do, not a bare OSError, and later captures are still refused."""
    p, j, _ = make(tmp_path)
    child = subprocess.Popen(["sleep", "60"])
    p.ctx.cgroup.members = [child.pid]
    rooted(p, child.pid)

    def lost() -> None:
        raise GpuRollbackError("GPU rollback failed", {child.pid: "NO_CUDA"})

    def refused() -> None:
        raise PermissionError(13, "Permission denied")
    p.ctx.gpu.resume, p.ctx.cgroup.kill_all = lost, refused
    p.prepare(1)
    p.capture(1, final=False)
    try:
        with pytest.raises(CaptureError) as e:
            p.resume(1)
        assert "killing the task failed (Permission denied)" in str(e.value) and "scancel" in str(e.value)
        with pytest.raises(CaptureError, match="nothing to capture: the task's tree was killed"):
            p.prepare(2)
    finally:
        child.kill()
        child.wait()


def test_a_tree_that_ended_is_typed_ended_before_anything_is_touched(tmp_path: Path) -> None:
    """The program exited (its rank is leaving the job): SIZE and PREPARE raise TaskEnded, whose periodic
    abort the ranks keep to themselves, and nothing was locked or frozen."""
    p, j, _ = make(tmp_path)
    child = subprocess.Popen(["true"])
    child.wait()
    p.ctx.cgroup.members = []
    rooted(p, child.pid)
    for phase in (p.size, p.prepare):
        with pytest.raises(TaskEnded, match="no running task tree"):
            phase(1)
    assert j.events == []


def test_what_the_gpu_cannot_capture_is_refused_at_the_check_stage_before_anything_is_locked(tmp_path: Path) -> None:
    """CUDA IPC, MPS, MIG...: named by the check stage (the GPU view of /proc), so the capture fails in
    `check` with nothing reserved, locked or frozen (docs/gpu.md, "CUDA IPC")."""
    p, j, _ = make(tmp_path)
    p.ctx.gpu.refused = ("pid 71 (learner) and pid 72 (actor) share GPU memory through CUDA IPC",)
    with pytest.raises(CaptureError, match="GPU state cannot be checkpointed: pid 71 .learner. and pid 72"):
        p.prepare(1)
    assert p.failed_stage == "check" and j.events == []


@pytest.mark.system
@pytest.mark.parametrize("path", ["resume", "abort", "final"])
def test_a_memory_limit_raised_for_the_capture_is_put_back_on_every_path(tmp_path: Path, monkeypatch, path: str):
    """The site lets root raise the job's limit (gpu_capture_memory_raise): raised after the space is
    reserved and before any GPU work, put back after the GPU restore (periodic), after the GPU rollback (an
    abort), or once the tree is killed (final); the watchdog covers a dead agent (test_capture_memory.py)."""
    from slurmckpt.node import host_memory
    from slurmckpt.rank import capture
    from slurmckpt.rank.context import CaptureState
    from slurmckpt.rank.fit import Footprint
    level = host_memory.Headroom(0, 24 << 30, "/job_7", 4 << 30, True, "/sys/fs/cgroup/job_7", True, ("memory.max",))
    made = host_memory.Raise("/sys/fs/cgroup/job_7", ("memory.max",), 35 << 30, "/job_7")
    p, j, _ = make(tmp_path, gpu_fail="gpu-checkpoint" if path == "abort" else "")
    monkeypatch.setattr(capture.host_memory, "raise_limits",
                        lambda plan, ledger: j.events.append(f"raise {plan[0][1] >> 30}") or [made])
    monkeypatch.setattr(capture.host_memory, "put_back",
                        lambda raised, ledger: j.events.append(f"put back {raised[0].by >> 30}") or [])
    p.ctx = replace(p.ctx, limits=Limits(memory_ledger=tmp_path / "ledger"))
    p.state = CaptureState(1, footprint=Footprint(3 << 30, GpuUse({11: {"GPU-a": 16 << 30}}), 500 << 30, (level,),
                                                   None, raise_allowed=True))
    if path == "abort":
        with pytest.raises(GpuError):
            p.prepare(1)
        assert j.events == ["raise 35", "gpu-lock", "gpu-checkpoint", "gpu-unlock", "put back 35"]
        return
    p.prepare(1)
    p.capture(1, final=path == "final")
    if path == "resume":
        p.resume(1)
        assert j.events[-3:] == ["gpu-resume", "gpu-unlock", "put back 35"]
    else:
        p.ctx.cgroup.members = []                # (the fake's tree is this test's own process otherwise)
        p.finish(1)
        assert j.events[-2:] == ["kill", "put back 35"]
    assert j.events[0] == "raise 35" and j.events.count("put back 35") == 1


def test_gpu_checkpoint_failure_unlocks_and_never_freezes(tmp_path: Path) -> None:
    p, j, _ = make(tmp_path, gpu_fail="gpu-checkpoint")
    with pytest.raises(GpuError):
        p.prepare(1)
    assert "freeze" not in j.events and j.events[-1] == "gpu-unlock"


@pytest.mark.parametrize("enters", ["before", "at-freeze"])
def test_a_rank_inside_a_pmi_exchange_is_sent_back_to_try_again(tmp_path: Path, enters: str) -> None:
    """The tree's rank waits for slurmstepd's answer to a PMI request: PREPARE fails with a retryable error
    so that the coordinator's next lock round can find it between exchanges. Already waiting when PREPARE
    starts: sent back before any GPU work or freeze. Entering the exchange just before the freeze: caught
    after it, and everything is undone (thawed, GPUs resumed and unlocked)."""
    import socket
    from tests.support.pmi_client import waiting_client
    from slurmckpt.errors import ExchangeInFlight, is_retryable
    theirs, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = waiting_client(theirs)
    try:
        stepd.recv(64)
        p, j, _ = make(tmp_path)
        if enters == "before":
            p.ctx.cgroup.members = [child.pid]
        else:                          # the tree looks idle until the freeze
            p.ctx.cgroup.members = []
            freeze = p.ctx.cgroup.freeze
            p.ctx.cgroup.freeze = lambda: (setattr(p.ctx.cgroup, "members", [child.pid]), freeze())[1]
        p.ctx.handovers.pmi_fd, p.ctx.handovers.pmi_ino = theirs.fileno(), os.fstat(theirs.fileno()).st_ino
        with pytest.raises(ExchangeInFlight) as e:
            p.prepare(1)
        assert is_retryable(e.value)
        if enters == "before":
            assert p.failed_stage == "pmi-precheck" and j.events == []
        else:
            assert p.failed_stage == "pmi-idle"
            assert j.events == ["gpu-lock", "gpu-checkpoint", "freeze", "thaw", "gpu-resume", "gpu-unlock"]
        assert p.ctx.cgroup.state() == "THAWED"
    finally:
        child.kill()
        child.wait()
        theirs.close()
        stepd.close()


def test_capture_without_prepare_is_refused(tmp_path: Path) -> None:
    p, _, _ = make(tmp_path)
    with pytest.raises(CaptureError):
        p.capture(1)


@pytest.mark.system
def test_abort_after_prepare_keeps_previous_commit(tmp_path: Path) -> None:
    p, j, store = make(tmp_path)
    p.prepare(1); p.capture(1, final=False)
    p.resume(1)
    store.commit(1, {"batch.0": {"kind": "image"}}, "interval", keep=2)
    p.prepare(2); p.capture(2, final=False)
    p.abort(2)
    assert [e["epoch"] for e in store.committed()] == [1]
    assert not store.rank_dir(2, "batch", 0).exists()
    store.verify_rank(1, "batch", 0)


def test_finish_kills_every_process_of_the_cgroup_not_only_the_root(tmp_path: Path) -> None:
    """GPU tasks run in the host PID namespace: the init's death does not take the tree with it. On a v1
    freezer every pid of the cgroup is killed while it is frozen, then the cgroup is thawed."""
    import subprocess
    from slurmckpt.node.task_cgroup import TaskCgroup
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "freezer.state").write_text("THAWED")
    (cg / "cgroup.procs").write_text("\n".join(str(q.pid) for q in procs))
    p, j, _ = make(tmp_path)
    rooted(p, procs[0].pid)
    p.ctx = replace(p.ctx, cgroup=TaskCgroup(cg, TreeName(7, "batch", 0, 0)))
    p.finish(1)
    assert [q.wait(5) for q in procs] == [-9, -9, -9]
    assert (cg / "freezer.state").read_text() == "THAWED"


@pytest.mark.system
def test_capture_sizes_criu_ghost_limit_from_what_the_tree_holds(tmp_path: Path) -> None:
    """A deleted 4 MiB shared-memory file (like OpenMPI's PMIx segment) held by the tree (this process): the
    dump gets --ghost-limit of at least its size and the rank's record lists it (docs/mpi.md)."""
    from test_ghost import deleted
    p, _, store = make(tmp_path)
    with deleted(tmp_path, "pmix-seg", (4 << 20) + 4096, mapped=True, keep_fd=False):
        p.prepare(1)
        p.capture(1, final=False)
    p.resume(1)
    assert p.ctx.criu.ghost_limit >= (4 << 20) + 4096
    ghosts = [g.to_json() for g in store.read_rank_manifest(1, "batch", 0).capture.files.ghosts]
    assert any(g["path"].endswith("pmix-seg") and g["size"] == (4 << 20) + 4096 for g in ghosts)


def test_deleted_files_above_the_cap_are_refused_before_anything_is_frozen(tmp_path: Path) -> None:
    from test_ghost import deleted
    p, j, _ = make(tmp_path, ghost_cap=2 << 20)
    with deleted(tmp_path, "too-big", 3 << 20, mapped=False, keep_fd=True):
        with pytest.raises(CaptureError, match=r"too-big \(3.0 MiB, open by pid"):
            p.prepare(1)
    assert "freeze" not in j.events and "dump" not in j.events and "gpu-lock" not in j.events


def test_a_restore_whose_gpu_state_fails_leaves_no_process_behind(tmp_path: Path) -> None:
    """CRIU brought the tree back, then the GPU restore failed: the restored processes are killed, the task
    cgroup is empty again and the runner holds no tree, so the wrapper's fallback (an older epoch or a fresh
    start) can start one; the error is the typed failure the fallback acts on."""
    import subprocess

    p, j, store = make(tmp_path, gpu_fail="gpu-restore")
    store.rank_dir(3, "batch", 0).mkdir(parents=True)
    (store.rank_dir(3, "batch", 0) / "pages-1.img").write_bytes(b"x")
    store.write_rank_manifest(3, "batch", 0, Capture(gpu=Gpu({"processes": [{"pid": 1, "ns_pid": 1}]})))
    store.commit(3, {"batch.0": {"kind": "image"}}, "test", 2)
    restored: list[subprocess.Popen] = []

    def fake_restore(images, inherit, *, freezer, pidfile=None, join=None, tcp_close=(), mntns=False, leave_stopped=False):
        restored.extend(subprocess.Popen(["sleep", "60"]) for _ in range(2))
        p.ctx.cgroup.members = [q.pid for q in restored]
        return restored[0].pid
    p.ctx.criu.restore = fake_restore
    rooted(p, None)
    with pytest.raises(GpuError):
        p.restore(p.ctx, 3, [0, 1, 2])
    assert [q.wait(5) for q in restored] == [-9, -9], "the restored processes were left running"
    assert p.root_pid is None and p.ctx.cgroup.pids() == []
    assert j.events[-2:] == ["gpu-restore", "kill"]


def test_an_interrupted_criu_restore_leaves_no_process_behind(tmp_path: Path) -> None:
    """criu restore was stopped at its timeout with part of the tree restored (criu did not take it back):
    those processes are killed before the fallback (an older epoch or a fresh start) runs, which needs the
    task cgroup empty; the error stays the typed criu failure."""
    p, j, store = make(tmp_path)
    store.rank_dir(3, "batch", 0).mkdir(parents=True)
    (store.rank_dir(3, "batch", 0) / "pages-1.img").write_bytes(b"x")
    store.write_rank_manifest(3, "batch", 0, Capture())
    store.commit(3, {"batch.0": {"kind": "image"}}, "test", 2)
    restored: list[subprocess.Popen] = []

    def interrupted(images, inherit, *, freezer, pidfile=None, join=None, tcp_close=(), mntns=False, leave_stopped=False):
        restored.extend(subprocess.Popen(["sleep", "60"]) for _ in range(2))
        p.ctx.cgroup.members = [q.pid for q in restored]
        raise CriuInterrupted("criu restore did not finish within 1s; it did not exit within 10s of SIGALRM "
                              "and was killed")
    p.ctx.criu.restore = interrupted
    rooted(p, None)
    with pytest.raises(CriuInterrupted):
        p.restore(p.ctx, 3, [0, 1, 2])
    assert [q.wait(5) for q in restored] == [-9, -9], "half-restored processes were left running"
    assert p.root_pid is None and p.ctx.cgroup.pids() == [] and "kill" in j.events


def test_size_refuses_what_cannot_fit_before_any_gpu_or_freeze_work(tmp_path: Path) -> None:
    """The SIZE phase measures the real tree (this process, the real /proc and MemAvailable) and refuses a GPU
    copy no node could hold, naming it; nothing is locked or frozen, and the stage is recorded as size."""
    p, j, _ = make(tmp_path)
    p.ctx.gpu.use = GpuUse({os.getpid(): {"GPU-x": 1 << 50}})
    with pytest.raises(CaptureError, match="capture refused before anything was locked: the GPU checkpoint copies "
                                           "1024.0 TiB of device memory"):
        p.size(1)
    assert p.failed_stage == "size" and j.events == [] and p.footprint is None
    p.ctx.gpu.use = GpuUse()
    reply = p.size(2)
    assert reply["gpu_bytes"] == 0 and reply["host_bytes"] > 0 and reply["notes"] == []
    assert p.footprint is not None and p.footprint.store_free > 0


@pytest.mark.system
@pytest.mark.parametrize("final", [False, True])
def test_a_tree_with_gpu_state_is_left_stopped_by_a_periodic_dump_and_handed_to_the_gpu_stage(
        tmp_path: Path, final: bool) -> None:
    """A periodic capture of a tree with CUDA processes: criu leaves it stopped, and the GPU stage gets the
    processes criu stopped (not one that was stopped already), to let them go once the GPU state is back. A final
    capture ends the tree: nothing is left stopped."""
    p, j, store = make(tmp_path)
    p.ctx.gpu.stops = True
    root = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    already = int(root.stdout.readline())          # a process of the tree the job had stopped itself
    os.kill(already, signal.SIGSTOP)
    try:
        _wait_for_state(already, "T")
        p.ctx.cgroup.members = [root.pid, already]
        p.ctx.criu.tree = [root.pid, already]
        rooted(p, root.pid)
        p.prepare(1)
        p.capture(1, final=final)
        if final:
            assert "dump" in j.events and not any(e.startswith("left-stopped") for e in j.events)
        else:
            assert j.events[-2:] == ["dump --leave-stopped", f"left-stopped {[root.pid]}"]
    finally:
        for pid in (already, root.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        root.wait()


@pytest.mark.system
def test_the_epoch_phase_follows_the_tables_the_runner_runs(tmp_path: Path) -> None:
    from slurmckpt.rank.context import Phase
    p, _, _ = make(tmp_path)
    p.prepare(1)
    assert p.state.phase is Phase.PREPARED and p.state.holding
    p.capture(1, final=False)
    assert p.state.phase is Phase.CAPTURED
    p.resume(1)
    assert p.state.phase is Phase.PERSISTED and not p.state.holding and PERSIST.stages == tuple(p.state.done)
    p.prepare(2)
    p.capture(2, final=True)
    assert p.state.phase is Phase.HANDED_OVER and p.state.holding
    p.state.persister.wait()
    p.ctx.cgroup.members = []                # (the fake's tree is this test's own process otherwise)
    p.finish(2)
    assert p.state.phase is Phase.FINISHED and p.state.done == []


@pytest.mark.system
@pytest.mark.parametrize("fails", ["check", "gpu-checkpoint", "dump", "none"])
def test_abort_drops_the_images_only_once_the_epoch_no_longer_holds_the_tree(tmp_path: Path, monkeypatch,
                                                                            fails: str) -> None:
    """The decision is the epoch's phase: a failing stage's own rollback never drops the epoch's images (a
    failure in PREPARE's first stage, with nothing done yet, did); the coordinator's ABORT after it does,
    as it does after RESUME; an ABORT while the tree is held runs the undos and keeps them."""
    from slurmckpt.rank import runner as runner_module
    p, j, _ = make(tmp_path, gpu_fail="gpu-checkpoint" if fails == "gpu-checkpoint" else "",
                   criu_fail=fails == "dump")
    if fails == "check":
        p.ctx.gpu.refused = ("MPS",)
    discarded: list[int] = []
    monkeypatch.setattr(runner_module.images, "discard", lambda ctx, epoch: discarded.append(epoch))
    if fails == "none":
        p.prepare(1)
        p.abort(1)                             # held: undone, nothing dropped
        assert discarded == [] and j.events[-3:] == ["thaw", "gpu-resume", "gpu-unlock"]
        p.prepare(2)
        p.capture(2, final=False)
        p.resume(2)
        p.abort(2)                             # after the thaw (the epoch failed elsewhere): dropped
        assert discarded == [2]
        return
    with pytest.raises((CaptureError, GpuError, CriuError)):
        p.prepare(1)
        p.capture(1, final=False)
    undone = [1] if fails == "dump" else []      # the undo of `record` drops what it staged
    assert p.failed_stage == fails and discarded == undone
    p.abort(1)                                 # the coordinator's ABORT of the epoch
    assert discarded == undone + [1]


class SlowCopy:
    """host_copy.copy_out standing in for the threads' copy: it waits until criu's dump has begun (or not,
    `alone`), and notes when it starts and ends."""

    def __init__(self, journal: Journal, fail: bool = False) -> None:
        self.journal, self.fail = journal, fail
        self.dumping = threading.Event()

    def copy_out(self, copies, images, threads, **context):
        self.journal.events.append("copy starts")
        beside = self.dumping.wait(5)
        self.journal.events.append(f"copy ends ({'beside' if beside else 'alone'})")
        if self.fail:
            raise CaptureError("copying the GPU host copy of pid 42: injected", **context)
        return [{"nspid": 1, "file": "host-copy-0.0.img"}], [], 0.2


def _with_host_copy(tmp_path: Path, monkeypatch, copy_fails: bool = False, criu_fail: bool = False):
    """A runner whose PREPARE found a GPU host copy, whose criu notes when it dumps (and waits a moment for
    a copy that runs beside it), and whose copy is SlowCopy."""
    from slurmckpt.rank import capture as capture_module
    p, j, store = make(tmp_path, criu_fail=criu_fail)
    slow = SlowCopy(j, copy_fails)
    monkeypatch.setattr(capture_module.host_copy, "copy_out", slow.copy_out)
    engine_dump = p.ctx.criu.dump

    def dump(pid, images, **kw):
        j.events.append(f"dump skips {kw['skip_pages']}")
        slow.dumping.set()
        time.sleep(0.2)
        return engine_dump(pid, images, **kw)
    monkeypatch.setattr(p.ctx.criu, "dump", dump)
    p.prepare(1)
    p.state.host_copies = {42: [(0x1000, 0x3000)], 43: [(0x8000, 0x9000)]}
    return p, j, store


def test_a_periodic_capture_copies_the_host_copy_beside_criu_s_dump_and_times_each_as_if_alone(
        tmp_path: Path, monkeypatch) -> None:
    """The copy and criu's dump overlap (each waits to see the other under way), criu is told to skip the
    copied pages before the copy ends, the record holds the copy, and each is timed under its own stage name:
    the final capture's cost is judged from those (coordinator/budget.py), and there they run in turn."""
    p, j, store = _with_host_copy(tmp_path, monkeypatch)
    out = p.capture(1, final=False)
    skips = "dump skips [(42, 4096, 12288), (43, 32768, 36864)]"
    assert "copy ends (beside)" in j.events and j.events.index(skips) < j.events.index("copy ends (beside)")
    assert p.state.host_copying is None and p.state.record.host_copy[0]["file"] == "host-copy-0.0.img"
    assert out["timings"]["host_copy"] == 0.2 and out["timings"]["host-copy"] > 0 and out["timings"]["dump"] >= 0.2
    p.resume(1)
    assert store.read_rank_manifest(1, "batch", 0).capture.gpu.host_copy[0]["file"] == "host-copy-0.0.img"


def test_a_final_capture_copies_the_host_copy_before_criu_dumps_and_ends_the_tree(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    p, j, _ = _with_host_copy(tmp_path, monkeypatch)
    p.capture(1, final=True)
    assert j.events.index("copy ends (alone)") < j.events.index(
        "dump skips [(42, 4096, 12288), (43, 32768, 36864)]")


@pytest.mark.parametrize("fails", ["dump", "copy"])
def test_a_failure_beside_the_copy_waits_for_it_raises_the_first_cause_and_rolls_back(
        tmp_path: Path, monkeypatch, fails: str) -> None:
    """criu failing while the copy runs: the copy is waited for (its threads never outlive the images the
    rollback discards) and criu's error is the one raised; the copy failing: its error, naming the pid.
    Either way the tree is thawed and the GPUs resumed, and the epoch's images are gone."""
    p, j, store = _with_host_copy(tmp_path, monkeypatch, copy_fails=fails == "copy", criu_fail=fails == "dump")
    with pytest.raises(CriuError if fails == "dump" else CaptureError,
                       match="injected criu failure" if fails == "dump" else "pid 42"):
        p.capture(1, final=False)
    assert j.events.index("copy ends (beside)") < j.events.index("thaw")
    assert j.events[-3:] == ["thaw", "gpu-resume", "gpu-unlock"] and p.state.host_copying is None
    assert p.failed_stage == "dump" and not store.rank_dir(1, "batch", 0).exists()
