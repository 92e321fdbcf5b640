"""A finished job's images go at its end (job_end.py, started by the SPANK plugin's job epilog): the one
reading of Slurm's word (reclaim.verdict) that gc shares, a bounded wait through the epilogs' COMPLETING,
a requeued job's images kept, one remover of several nodes, the summary kept and saying so, and gc left to
decide whatever is not settled in time. Slurm and the clock are fakes; the store and its lock are real."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from slurmckpt.store import job_end
from slurmckpt.store import summary
from slurmckpt.store import reclaim
from slurmckpt.config import Config
from slurmckpt.errors import SlurmError
from slurmckpt.store.instance import JobInstance, claim
from slurmckpt.rank import leftovers
from slurmckpt.store.job_end import JobEnd
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from store_harness import Tree, capture, images, rank_runner

UID = 60021


def end(job: JobEnd, config: Config, slurm, *timing):
    """The job end as `slurmckpt job-end` runs it: lifting the job's TCP holds on this node first."""
    return job_end.end(job, config, slurm, leftovers.lift_tcp_holds, *timing)


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def stored(tmp_path: Path, tree: Tree, job: int = 50, uid: int = UID) -> JobStore:
    """A job's store with one committed epoch, bound to `uid` as the agents bind it."""
    store = JobStore(tmp_path / "images", "c", job)
    store.ensure()
    claim(store, JobInstance("c", job, uid, uid, "2026-01-01T00:00:00", 0))
    capture(rank_runner(store, Staging(tmp_path / "staging"), tree, images(job)), 1)
    return store


def config(tmp_path: Path, **keys: object) -> Config:
    return Config.from_mapping({"storage_root": str(tmp_path / "images"), "staging_dir": str(tmp_path / "staging"),
                                "summary_dir": str(tmp_path / "summaries"), **keys})


class Slurm:
    """slurmctld's answers, one per question (the last repeats); an exception is raised instead."""

    def __init__(self, *answers: str | None | Exception) -> None:
        self.answers, self.asked = list(answers), 0

    def cluster_name(self) -> str:
        return "c"

    def job_states(self, job_ids: list[int]) -> dict[int, str]:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return {} if answer is None else {job_ids[0]: answer}


class Clock:
    def __init__(self) -> None:
        self.now, self.pauses = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("state, said", [
    ("COMPLETED", "finished"), ("CANCELLED", "finished"), ("TIMEOUT", "finished"), ("PREEMPTED", "finished"),
    ("COMPLETING", "settling"),                     # 22.05, whether the job ended or is being requeued
    ("COMPLETED+COMPLETING", "settling"), ("PENDING+COMPLETING+REQUEUED", "settling"),  # 23.02+
    ("COMPLETED+STAGE_OUT", "settling"),
    ("PENDING", "runs-again"), ("REQUEUED", "runs-again"), ("PENDING+REQUEUED", "runs-again"),
    ("REQUEUE_HOLD", "runs-again"), ("SPECIAL_EXIT", "runs-again"), ("RUNNING", "runs-again"),
    (None, "unknown")])
def test_one_reading_of_slurms_word_for_gc_and_the_jobs_end(state, said):
    assert reclaim.verdict(state) == said


@pytest.mark.system
def test_a_completed_job_loses_its_images_once_the_epilogs_are_through_and_its_summary_says_so(tmp_path, tree):
    store = stored(tmp_path, tree)
    summary.publish(store, str(tmp_path / "summaries"), UID)
    clock = Clock()
    slurm = Slurm("COMPLETING", "COMPLETED+COMPLETING", "COMPLETED")
    said = end(JobEnd(50, UID, "node1", "node[1-3]"), config(tmp_path), slurm, clock, clock.sleep)
    assert said.startswith("removed ") and said.endswith("of images: job COMPLETED"), said
    assert not store.job_dir.exists() and not list((tmp_path / "images" / "c").glob(".trash-*"))
    assert slurm.asked == 3 and clock.pauses == [1.0, 1.0]
    kept = summary.read(str(tmp_path / "summaries"), "c", 50)
    assert kept["epochs"] and kept["epochs"][0]["epoch"] == 1, kept          # what the job had
    assert kept["images_removed"]["why"] == "job COMPLETED" and kept["images_removed"]["at"] > 0


@pytest.mark.parametrize("states", [("COMPLETING", "PENDING"), ("COMPLETING", "REQUEUED"),
                                    ("PENDING+COMPLETING+REQUEUED", "PENDING+REQUEUED"), ("REQUEUE_HOLD",)])
def test_a_requeued_job_keeps_its_images(tmp_path, tree, states):
    store = stored(tmp_path, tree)
    clock = Clock()
    said = end(JobEnd(50, UID), config(tmp_path), Slurm(*states), clock, clock.sleep)
    assert said == f"images kept: job {states[-1]}, it runs again"
    assert store.committed()


@pytest.mark.parametrize("answer", ["COMPLETING", None, SlurmError("squeue --json exited 1: timed out")])
def test_without_a_final_word_in_time_the_images_are_left_to_gc(tmp_path, tree, answer):
    store = stored(tmp_path, tree)
    clock = Clock()
    slurm = Slurm(answer)
    said = end(JobEnd(50, UID), config(tmp_path), slurm, clock, clock.sleep)
    assert said.startswith(f"left to gc: no final word from Slurm within {job_end.WAIT_S:.0f}s"), said
    assert store.committed()
    assert clock.now >= job_end.WAIT_S and max(clock.pauses) == job_end.PAUSES[-1]
    assert slurm.asked <= job_end.WAIT_S / job_end.PAUSES[-1] + len(job_end.PAUSES) + 1


def test_keep_finished_keeps_them_at_the_end_too(tmp_path, tree):
    store = stored(tmp_path, tree)
    said = end(JobEnd(50, UID), config(tmp_path, keep_finished=True), Slurm("COMPLETED"))
    assert said.startswith("kept ") and "keep_finished is set" in said and store.committed()


def test_only_the_first_node_asks_slurm_and_a_list_it_cannot_read_lets_every_node_act(tmp_path, tree):
    store = stored(tmp_path, tree)
    slurm = Slurm("COMPLETED")
    assert end(JobEnd(50, UID, "node2", "node[1-3]"), config(tmp_path), slurm).startswith("left to the job's first")
    assert slurm.asked == 0 and store.committed()
    assert JobEnd(50, UID, "rack1-n1", "rack[1-2]-n[1-4]").acts_here()        # node not in what was read
    assert JobEnd(50, UID, "node2", "").acts_here() and JobEnd(50, UID, "", "node[1-3]").acts_here()
    assert not JobEnd(50, UID, "gpu7", "node1,gpu7").acts_here()
    assert end(JobEnd(50, UID, "node1", "node[1-3]"), config(tmp_path), slurm).startswith("removed ")


def test_nodes_ending_one_job_together_remove_it_once(tmp_path, tree):
    """Every node acts when the node list is not known: the job's lock lets one rename the store, the others
    find nothing, and none fails."""
    store = stored(tmp_path, tree)
    said: list[str] = []
    threads = [threading.Thread(target=lambda: said.append(end(JobEnd(50, UID), config(tmp_path),
                                                               Slurm("COMPLETED")))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    removed = [s for s in said if s.startswith("removed ") and "already removed" not in s]
    assert len(said) == 4 and len(removed) == 1, said
    assert all(s.startswith(("removed ", "no images")) for s in said), said
    assert not store.job_dir.exists()


def test_a_store_bound_to_another_uid_and_a_job_without_images_are_left_alone(tmp_path, tree):
    store = stored(tmp_path, tree, uid=UID + 1)
    slurm = Slurm("COMPLETED")
    said = end(JobEnd(50, UID), config(tmp_path), slurm)
    assert said == f"left to gc: the store is bound to uid {UID + 1}, Slurm's job to uid {UID}"
    assert slurm.asked == 0 and store.committed()
    assert end(JobEnd(51, UID), config(tmp_path), slurm) == "no images in the store" and slurm.asked == 0


@pytest.mark.system
def test_gc_marks_the_summary_of_what_it_removes(tmp_path, tree):
    store = stored(tmp_path, tree)
    summary.publish(store, str(tmp_path / "summaries"), UID)
    out = reclaim.collect_finished(tmp_path / "images", "c", {50: "CANCELLED"}, False,
                                   summary_dir=str(tmp_path / "summaries"))
    assert [(r.kind, r.why) for r in out] == [("finished-job", "job CANCELLED")] and not store.job_dir.exists()
    assert summary.read(str(tmp_path / "summaries"), "c", 50)["images_removed"]["why"] == "job CANCELLED"


def test_the_jobs_end_lifts_its_tcp_holds_on_every_node_first_and_only_its_own(tmp_path, monkeypatch):
    """A job killed mid-restore left the holds of its first rank (the other ends never came): every node's
    epilog lifts what the job holds there, whether that node goes on to ask Slurm or not, and whether the
    store has images or not; another job's holds stay."""
    from fake_filters import FakeIptables, FakeNftables
    from slurmckpt.node import packet_filter
    from slurmckpt.rank.sharing import netlock, rendezvous
    ipt, nft = FakeIptables(), FakeNftables()
    monkeypatch.setattr(rendezvous, "LOCK_DIR", tmp_path / "sync")
    monkeypatch.setattr(packet_filter, "installed", lambda: [ipt.filter(), nft.filter()])
    conns = [[f"127.0.0.1:{20000 + i}", "127.0.0.1:5000"] for i in range(300)]
    for job, packets in ((50, ipt.filter()), (50, nft.filter()), (60, ipt.filter())):
        with netlock.hold_during_restore(conns, rendezvous.restore_key(job, 0, 3), packets, 1024):
            pass
    slurm = Slurm("COMPLETED")
    assert end(JobEnd(50, UID, "node2", "node[1-3]"), config(tmp_path), slurm).startswith("left to the job's first")
    assert ipt.job_chains() == ["SLURMCKPT-60"] and nft.tables == {} and slurm.asked == 0
    assert not list((tmp_path / "sync").glob("50.*")) and list((tmp_path / "sync").glob("60.*"))
    assert end(JobEnd(60, UID), config(tmp_path), slurm) == "no images in the store"
    assert ipt.rules() == [] and not list((tmp_path / "sync").glob("6*.*"))


def test_gc_lifts_the_tcp_holds_of_jobs_that_are_gone_only(tmp_path, monkeypatch):
    """gc, the safety net where no epilog ran: the holds of a finished job and of one Slurm knows nothing of
    go, a running or pending job's stay (its restore may be under way)."""
    from fake_filters import FakeIptables
    from slurmckpt.node import packet_filter
    ipt = FakeIptables()
    for job in (70, 71, 72, 73):
        packet_filter.update(ipt.filter(), job, [packet_filter.Drop("127.0.0.1", 1, "127.0.0.1", 2)])
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / ".lock-74").touch()                                  # held here once, nothing left
    jobs = leftovers.tcp_hold_jobs([ipt.filter()], sync)
    assert jobs == {70, 71, 72, 73, 74}
    states = {70: "COMPLETED", 71: "RUNNING", 72: "PENDING"}
    dry = leftovers.collect_tcp_holds(jobs, states, [ipt.filter()], dry_run=True, lock_dir=sync)
    assert [(r.path, r.why) for r in dry] == [("job 70: iptables: 1 rule(s)", "job COMPLETED"),
                                              ("job 73: iptables: 1 rule(s)", "Slurm knows no such job"),
                                              ("job 74: no rule left", "Slurm knows no such job")]
    assert len(ipt.job_chains()) == 4
    done = leftovers.collect_tcp_holds(jobs, states, [ipt.filter()], lock_dir=sync)
    assert [r.kind for r in done] == ["tcp-hold"] * 3
    assert ipt.job_chains() == ["SLURMCKPT-71", "SLURMCKPT-72"] and not list(sync.glob(".lock-7[034]"))


def test_images_moved_aside_for_another_instance_of_the_id_stay_for_the_admins(tmp_path, tree):
    """A store bound to another instance of the job id is moved aside (`.stale-<job>-*`, instance.py) and
    kept for the admins (docs/storage.md): the new job's end, and gc, remove the new job's images only, and
    gc lists what is kept."""
    old = stored(tmp_path, tree, uid=UID + 1)
    assert claim(old, JobInstance("c", 50, UID, UID, "2026-02-01T00:00:00", 0))       # the id's new job
    stale = list((tmp_path / "images" / "c").glob(".stale-50-*"))
    assert len(stale) == 1
    assert end(JobEnd(50, UID), config(tmp_path), Slurm("COMPLETED")).startswith("removed ")
    assert stale[0].is_dir() and (stale[0] / "manifest.json").exists()
    listed = reclaim.collect_moved_aside(tmp_path / "images", "c")
    assert [(r.kind, r.path) for r in listed] == [("kept", str(stale[0]))] and "admins" in listed[0].why
