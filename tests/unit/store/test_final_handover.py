"""A final capture's images after Slurm's SIGKILL (store/handover.py, store/final_persist.py, rank/images.py
hand_over, node/detach.py): on the store harness, real staging, persist and store, the persister run in this
process (what `slurmckpt persist-final` runs), CRIU and the cgroup stood in for. Each test says which part of
docs/storage.md ("The final capture and Slurm's SIGKILL") it holds."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from slurmckpt.errors import StorageError
from slurmckpt.node import detach, procfs
from slurmckpt.store import fresh_start, handover, lease
from slurmckpt.store.jobstore import JobStore
from slurmckpt.store.staging import Staging
from slurmckpt.store.record import Capture
from store_harness import InProcess, Tree, images, rank_runner, read_back, settled

RANKS = {"batch.0": {"kind": "image", "node": "n1"}}


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


class Job:
    """One rank of a job whose final capture is handed to a persister that waits for `go` (the SIGKILL)."""

    def __init__(self, tmp_path: Path, tree: Tree, run: int = 0) -> None:
        self.store, self.staging = JobStore(tmp_path / "images", "c", 7), Staging(tmp_path / "staging")
        self.go = threading.Event()
        self.spawn = InProcess(self.store, self.staging, hold=self.go)
        self.p = rank_runner(self.store, self.staging, tree, images(1))
        self.p.ctx = self.p.ctx.__class__(**{**self.p.ctx.__dict__,
                                            "policy": self.p.ctx.policy.__class__(
                                                **{**self.p.ctx.policy.__dict__, "spawn": self.spawn})})
        self.run = run
        self.store.enter_run(run)

    def periodic(self, files: dict[str, bytes]) -> int:
        epoch = self.store.allocate_epoch(1, 600, "test", run=self.run)
        self.p.ctx.criu.files = files
        self.p.prepare(epoch)
        self.p.capture(epoch, final=False)
        self.p.resume(epoch)
        self.store.commit(epoch, RANKS, "interval", 2, run=self.run)
        return epoch

    def final(self, files: dict[str, bytes]) -> int:
        """SIGTERM: the final epoch begun, dumped into staging, handed over and the hand-over recorded: all
        inside Slurm's window. The persister has not run yet."""
        epoch = self.store.allocate_epoch(1, 600, "test", run=self.run)
        handover.began(self.store, epoch, self.run)
        self.p.ctx.criu.files = files
        self.p.prepare(epoch)
        reply = self.p.capture(epoch, final=True)
        assert reply["persisting"] is True and reply["bytes"] > 0
        assert not self.store.rank_dir(epoch, "batch", 0).exists(), "nothing reached the store inside the window"
        assert handover.pend(self.store, epoch, RANKS, "sigterm", self.run, 2) is False
        return epoch

    def persisted(self) -> bool:
        self.go.set()
        handle = self.spawn.started[-1]
        handle.wait(30)
        return bool(handle.ok)


def newest(store: JobStore) -> int:
    return store.committed()[0]["epoch"]


def test_the_final_capture_is_persisted_and_committed_after_the_sigkill_and_restores_exactly(tmp_path, tree):
    """Inside the window only the dump into staging; the persister commits the epoch afterwards, and the
    images read back are the ones dumped."""
    job = Job(tmp_path, tree)
    first = job.periodic(images(1))
    final = job.final(images(2))
    assert newest(job.store) == first
    assert [p["epoch"] for p in handover.pending(job.store.read_manifest())] == [final]
    assert job.persisted()
    assert newest(job.store) == final and handover.pending(job.store.read_manifest()) == []
    entry = job.store.committed()[0]
    assert entry["ranks"] == RANKS and entry["reason"] == "sigterm" and entry["run"] == 0
    assert read_back(job.store, final, tmp_path / "back") == images(2)
    assert settled(job.staging) == []
    assert handover.requeue_cost(job.store, entry) == \
        "the requeue lost nothing: it is the final capture, taken at Slurm's signal"


def test_a_persist_done_before_the_hand_over_record_is_committed_by_the_record(tmp_path, tree):
    job = Job(tmp_path, tree)
    job.periodic(images(1))
    epoch = job.store.allocate_epoch(1, 600, "test", run=0)
    job.p.prepare(epoch)
    job.p.capture(epoch, final=True)
    job.go.set()
    job.spawn.started[-1].wait(30)
    assert newest(job.store) != epoch, "no hand-over record yet: nothing commits"
    assert handover.pend(job.store, epoch, RANKS, "sigterm", 0, 2) is True
    assert newest(job.store) == epoch


def test_a_late_final_commit_keeps_the_run_fence(tmp_path, tree):
    """The hand-over is fenced like a commit; the persister's commit after the requeue (the store already at
    the next run) goes through because its record was written while its run was the store's, and the next
    run waited for it. A plain commit of the old run stays refused."""
    job = Job(tmp_path, tree)
    job.periodic(images(1))
    final = job.final(images(2))
    assert job.store.enter_run(1) == 1                         # the requeued run's agents start
    assert job.persisted()
    assert newest(job.store) == final
    with pytest.raises(StorageError, match="commit refused: this is run 0"):
        job.store.commit(final, RANKS, "interval", 2, run=0)
    late = job.store.allocate_epoch(1, 600, "x", run=1)
    with pytest.raises(StorageError, match="hand-over refused: this is run 0 of the job"):
        handover.pend(job.store, late, RANKS, "sigterm", 0, 2)


def test_the_next_run_waits_for_a_live_persister(tmp_path, tree):
    job = Job(tmp_path, tree)
    job.periodic(images(1))
    final = job.final(images(2))
    job.store.enter_run(1)
    ticks = []

    def sleep(s: float) -> None:       # the persister finishes while the next run's agent waits
        ticks.append(s)
        if len(ticks) == 3:
            assert job.persisted()
    out = handover.settle(job.store, 600, sleep=sleep)
    assert out.committed == (final,) and out.abandoned == () and len(ticks) == 3
    assert newest(job.store) == final
    assert "reached the image store after the job ended" in out.describe()


def test_a_persister_that_died_mid_persist_is_given_up_and_the_previous_commit_stays(tmp_path, tree):
    """A node crash: the persister's heartbeat runs out, its rank has no rank.json. The next run withdraws the
    epoch (never committed, even if a persister came back), records why, and restores the previous one."""
    job = Job(tmp_path, tree)
    first = job.periodic(images(1))
    final = job.final(images(2))
    clock = [lease.clock() + handover.HEARTBEAT_S + 1]           # the agent's first heartbeat has run out
    out = handover.settle(job.store, 600, clock=lambda: clock[0], sleep=lambda s: None)
    assert out.committed == () and [e for e, _ in out.abandoned] == [final]
    assert "the persist of rank batch.0 stopped before its images were complete" in out.describe()
    assert newest(job.store) == first
    assert job.persisted(), "the late persister's own images are written..."
    assert newest(job.store) == first, "...and still commit nothing"
    assert any(r["epoch"] == final for r in job.store.read_manifest()["rejected"])
    lost = fresh_start.failures(job.store)[0]
    assert lost.epoch == final and lost.final and lost.stage == "persist"
    cost = handover.requeue_cost(job.store, job.store.committed()[0])
    assert cost.startswith("taken ") and f"the final capture (epoch {final}) was lost: its images did not reach " \
                                            "the store after the job ended: the persist of rank batch.0 stopped" in cost


def test_a_persister_slower_than_the_wait_is_given_up(tmp_path, tree):
    job = Job(tmp_path, tree)
    job.periodic(images(1))
    final = job.final(images(2))
    now = [lease.clock()]

    def sleep(s: float) -> None:
        now[0] += 100
        lease.extend(job.store, final, handover.heartbeat("batch.0"), now[0] + 30)     # alive, but slow
    out = handover.settle(job.store, 250, clock=lambda: now[0], sleep=sleep)
    assert out.abandoned == ((final, "rank batch.0's images were not in the store within 250 s"),)
    job.persisted()


def test_ranks_sealed_by_persisters_that_died_before_committing_are_committed_by_the_next_run(tmp_path, tree):
    job = Job(tmp_path, tree)
    job.periodic(images(1))
    final = job.final(images(2))
    manifest = job.store.read_manifest()
    saved = manifest["pending"]
    manifest["pending"] = []
    job.store.write_manifest(manifest)               # as if the record came after the persister's try
    assert job.persisted() and newest(job.store) != final
    manifest = job.store.read_manifest()
    manifest["pending"] = saved
    job.store.write_manifest(manifest)
    assert handover.settle(job.store, 600, sleep=lambda s: None).committed == (final,)
    assert newest(job.store) == final


def test_a_failed_persist_withdraws_the_epoch_and_says_why(tmp_path, tree, monkeypatch):
    from slurmckpt.store import persist
    job = Job(tmp_path, tree)
    first = job.periodic(images(1))
    final = job.final(images(2))

    def full(*a, **kw):        # the store's file system is full
        raise StorageError("persisting pages-1.img to the store failed: No space left on device")
    monkeypatch.setattr(persist, "persist_rank", full)
    assert not job.persisted()
    assert newest(job.store) == first and handover.pending(job.store.read_manifest()) == []
    assert any(r["epoch"] == final for r in job.store.read_manifest()["rejected"])
    assert "No space left on device" in fresh_start.failures(job.store)[0].reason
    assert settled(job.staging) == []


def test_an_abort_after_the_hand_over_stops_the_persister_and_drops_its_images(tmp_path, tree):
    job = Job(tmp_path, tree)
    first = job.periodic(images(1))
    epoch = job.store.allocate_epoch(1, 600, "test", run=0)
    job.p.prepare(epoch)
    job.p.capture(epoch, final=True)
    job.p.abort(epoch)                       # another rank failed: the coordinator aborts the epoch
    job.go.set()
    job.spawn.started[-1].wait(30)
    assert not job.store.rank_dir(epoch, "batch", 0).exists() and newest(job.store) == first


def test_a_persister_that_cannot_start_fails_the_final_capture_at_once_and_the_previous_commit_stays(tmp_path, tree):
    """A persister that exits with an error right after its start (it could not even import its package)
    fails the hand-over inside the window, said as the capture's failure, instead of a final epoch handed
    to nobody and found lost by the next run."""
    class Failed:
        pid = 1

        def poll(self) -> int:
            return 1

        def kill(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            return 1

    job = Job(tmp_path, tree)
    first = job.periodic(images(1))
    job.p.ctx = job.p.ctx.__class__(**{**job.p.ctx.__dict__, "policy": job.p.ctx.policy.__class__(
        **{**job.p.ctx.policy.__dict__, "spawn": lambda argv, env: Failed()})})
    epoch = job.store.allocate_epoch(1, 600, "test", run=0)
    job.p.prepare(epoch)
    with pytest.raises(Exception, match="persister failed at its start"):
        job.p.capture(epoch, final=True)
    assert not job.store.rank_dir(epoch, "batch", 0).exists() and newest(job.store) == first


# ---- leaving the job's cgroups --------------------------------------------------------------------------
def test_the_persister_leaves_every_cgroup_of_the_job(tmp_path):
    """Hybrid host (cgroup v1 controllers, v2 at unified): every v1 hierarchy's root, and slurmckpt's own
    v2 cgroup; hierarchies where it already is at the root are left alone."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "321").mkdir(parents=True)
    fs = tmp_path / "sys"
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        f"30 25 0:26 / {fs}/freezer rw - cgroup cgroup rw,freezer\n"
        f"31 25 0:27 / {fs}/memory rw - cgroup cgroup rw,memory\n"
        f"32 25 0:28 / {fs}/pids rw - cgroup cgroup rw,pids\n"
        f"33 25 0:29 / {fs}/unified rw - cgroup2 cgroup2 rw\n")
    (tmp_path / "proc" / "321" / "cgroup").write_text(
        "7:freezer:/slurm/uid_1001/job_9/step_batch\n6:memory:/slurm/uid_1001/job_9/step_batch/task_0\n"
        "5:pids:/\n0::/\n")
    for d in ("freezer", "memory", "pids", "unified"):
        (fs / d).mkdir(parents=True)
    with procfs.rooted(tmp_path / "proc"):
        assert detach.destinations(321) == [fs / "freezer" / "cgroup.procs", fs / "memory" / "cgroup.procs",
                                            fs / "unified" / "slurmckpt" / "outlive" / "cgroup.procs"]
        assert detach.leave_job_cgroups(321) == []
    assert (fs / "memory" / "cgroup.procs").read_text() == "321"
    assert (fs / "unified" / "slurmckpt" / "outlive" / "cgroup.procs").read_text() == "321"


def test_a_handed_over_staging_area_belongs_to_its_persister(tmp_path):
    """The node's gc keeps an area while the process in its .owner lives: the agent that dumped it is gone
    after the SIGKILL, its persister is not."""
    import os
    staging = Staging(tmp_path / "staging")
    area = staging.make(staging.area("c", 7, "capture", 3, "batch", 0))
    (area / ".owner").write_text(json.dumps({"pid": os.getpid(), "start": "1"}))     # its agent is gone
    assert area in staging.orphans()
    staging.hand_to(area, os.getpid())
    assert area not in staging.orphans()
    assert json.loads((area / ".owner").read_text())["pid"] == os.getpid()


def test_a_wrapper_that_calls_any_commit_final_gets_nothing_committed_its_ranks_did_not_seal(tmp_path, tree):
    """The hosting wrapper (the job's user) says `final` on a commit: the agent records a hand-over, and only
    ranks sealed in this job's store can ever commit it. An epoch none of whose ranks dumped stays uncommitted,
    the next run withdraws it at once (no persister's heartbeat) and restores the previous commit."""
    from test_agent_logic import FakeChannel, make_agent
    from slurmckpt.config import Config
    a = make_agent(tmp_path, FakeChannel())
    a.facts.config = Config.from_mapping({})
    first = a.facts.store.allocate_epoch(1, 600, "t", run=a.facts.ident.restart_count)
    rdir = a.facts.store.rank_dir(first, "0", 0)
    rdir.mkdir(parents=True)
    (rdir / "pages-1.img").write_bytes(b"x")
    a.facts.store.write_rank_manifest(first, "0", 0, Capture())
    a.job.commit({"epoch": first, "ranks": {"0.0": {"kind": "image", "node": "n1"}}, "reason": "interval"}, [])
    lie = a.facts.store.allocate_epoch(1, 600, "t", run=a.facts.ident.restart_count)
    assert a.job.commit({"epoch": lie, "ranks": {"0.0": {"kind": "image", "node": "n1"}}, "reason": "interval",
                        "final": True}, []) == {"committed": False}
    assert a.facts.store.committed()[0]["epoch"] == first
    out = handover.settle(a.facts.store, 600, sleep=lambda s: None)
    assert out.abandoned and out.abandoned[0][0] == lie and a.facts.store.committed()[0]["epoch"] == first
