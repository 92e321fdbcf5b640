"""Space rules checked before a capture freezes anything (quotas, staging cap), the manifest's fallback to
its previous version, keep-N per rank, and garbage collection: finished jobs by Slurm's word, orphaned
staging areas, `slurmckpt gc`."""
from __future__ import annotations

from dataclasses import replace

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmckpt.rank import fit
from slurmckpt import cli
from slurmckpt.store import space
from slurmckpt.store import reclaim
from slurmckpt.store.record import RankRecord
from slurmckpt.config import Config
from slurmckpt.errors import CaptureError
from slurmckpt.store.instance import JobInstance, claim
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JOB_MANIFEST, PREVIOUS, JobStore
from cgroupfs import fake_rmdir
from fake_slurm import FakeSlurm, Ran, squeue_states
from store_harness import Tree, capture, images, rank_runner, read_back, settled


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def bound(store: JobStore, uid: int) -> JobStore:
    store.ensure()
    claim(store, JobInstance(store.cluster, store.job, uid, uid, "2026-01-01T00:00:00", 0))
    return store


def test_quota_job_refuses_before_anything_is_frozen_and_names_the_key(tmp_path, tree):
    store = bound(JobStore(tmp_path / "images", "c", 5), 1001)
    staging = Staging(tmp_path / "staging")
    p = rank_runner(store, staging, tree, images(1, kib=256))
    capture(p, 1)
    # room for what is stored now and half of a second image like the first
    p.ctx = replace(p.ctx, policy=p.ctx.policy.__class__(staging, p.ctx.policy.codec, p.ctx.policy.priority,
                                  space.Quotas(job=space.job_usage(store) * 3 // 2)))
    with pytest.raises(CaptureError, match=r"job 5's images would take .* over quota_job [\d.]+ KiB"):
        p.prepare(2)
    assert p.ctx.cgroup.state() == "THAWED" and p.failed_stage == "space"
    assert not store.epoch_dir(2).exists() and staging.areas() == []
    assert [e["epoch"] for e in store.committed()] == [1]
    assert read_back(store, 1, tmp_path / "back") == images(1, kib=256)


def test_quota_user_counts_every_job_of_the_user_and_no_other(tmp_path, tree, monkeypatch):
    monkeypatch.setattr(fit, "tree_memory", lambda pids: 300 << 10)      # the new job's tree
    root = tmp_path / "images"
    staging = Staging(tmp_path / "staging")
    me = os.getuid()                      # the rank's credentials: the job's user
    mine, theirs = bound(JobStore(root, "c", 5), me), bound(JobStore(root, "c", 6), 1002)
    capture(rank_runner(theirs, staging, tree, images(2, kib=512)), 1)        # another user's: not counted
    p = rank_runner(mine, staging, tree, images(1, kib=256))
    capture(p, 1)
    quota = space.Quotas(user=space.job_usage(mine) + (100 << 10))
    other_job = bound(JobStore(root, "c", 7), me)
    q = rank_runner(other_job, staging, tree, images(3, kib=256), quotas=quota)
    with pytest.raises(CaptureError, match=r"uid \d+'s images would take .* over quota_user"):
        q.prepare(1)
    assert space.user_usage(mine, me) == space.job_usage(mine) + space.job_usage(other_job)
    assert space.user_usage(mine, 1002) >= 512 << 10


def test_reservations_of_ranks_checking_at_once_count_against_the_quota(tmp_path):
    store = JobStore(tmp_path / "images", "c", 5)
    need = space.Need(raw=400 << 10, stored=400 << 10)
    quotas = space.Quotas(job=1 << 20)
    space.reserve_store(store, 3, "0", 0, need, quotas, 1001)
    space.reserve_store(store, 3, "0", 1, need, quotas, 1001)
    with pytest.raises(CaptureError, match="over quota_job"):
        space.reserve_store(store, 3, "0", 2, need, quotas, 1001)
    assert space.job_usage(store) >= 800 << 10


def test_staging_cap_refuses_with_the_key_named(tmp_path, tree):
    store = JobStore(tmp_path / "images", "c", 5)
    staging = Staging(tmp_path / "staging", cap=100 << 10)
    p = rank_runner(store, staging, tree, images(1))
    p.ctx = replace(p.ctx, policy=p.ctx.policy.__class__(staging, p.ctx.policy.codec, p.ctx.policy.priority, p.ctx.policy.quotas))
    with pytest.raises(CaptureError, match=r"staging area .* over staging_max"):
        p.prepare(1)
    assert staging.areas() == [] and not list(store.job_dir.glob("epoch-*/.reserve-*"))


def test_expected_size_uses_the_larger_of_memory_and_the_last_image_and_its_ratio():
    previous = RankRecord.from_json({"files": {"a": {"size": 100, "raw_size": 400}, "b": {"size": 50}}})
    assert space.expected(1000, None) == space.Need(1000, 1000)
    need = space.expected(200, previous)
    assert need.raw == 450 and need.stored == 150
    assert space.expected(900, previous) == space.Need(900, 300)


@pytest.mark.system
def test_staging_must_be_roots_and_private(tmp_path):
    Staging(tmp_path / "s").ensure()
    assert oct((tmp_path / "s").stat().st_mode & 0o777) == "0o700"
    os.chmod(tmp_path / "s", 0o755)
    Staging(tmp_path / "s").ensure()
    assert oct((tmp_path / "s").stat().st_mode & 0o777) == "0o700"
    os.symlink(tmp_path / "s", tmp_path / "link")
    with pytest.raises(Exception, match="staging_dir"):
        Staging(tmp_path / "link").ensure()
    os.chown(tmp_path / "s", 1001, 1001)
    with pytest.raises(Exception, match="not a directory owned by root"):
        Staging(tmp_path / "s").ensure()


# ---- the manifest and keep-N -------------------------------------------------------------------------------
def test_an_unreadable_manifest_falls_back_to_the_previous_one(tmp_path, tree):
    store = JobStore(tmp_path / "images", "c", 5)
    p = rank_runner(store, Staging(tmp_path / "staging"), tree, images(1))
    capture(p, 1, keep=3)
    capture(p, 2, keep=3)
    assert json.loads((store.job_dir / PREVIOUS).read_text())["epochs"][-1]["epoch"] == 1
    (store.job_dir / JOB_MANIFEST).write_bytes(b'{"version": 1, "epochs": [{"epo')     # torn by the disk
    assert [e["epoch"] for e in store.committed()] == [1]
    capture(p, 3, keep=3)           # a commit after that keeps the good one as previous, not the torn one
    assert [e["epoch"] for e in store.committed()] == [3, 1]
    assert [e["epoch"] for e in json.loads((store.job_dir / PREVIOUS).read_text())["epochs"]] == [1]


def test_keep_n_is_per_rank_so_steps_with_own_coordinators_keep_their_newest(tmp_path, tree):
    store = JobStore(tmp_path / "images", "c", 5)
    staging = Staging(tmp_path / "staging")
    one = rank_runner(store, staging, tree, images(1), step="1")
    two = rank_runner(store, staging, tree, images(2), step="2")
    capture(two, store.allocate_epoch(1, 60, "step 2"))
    for _ in range(4):
        capture(one, store.allocate_epoch(1, 60, "step 1"))
    held = {e["epoch"]: sorted(e["ranks"]) for e in store.committed()}
    assert held == {5: ["1.0"], 4: ["1.0"], 1: ["2.0"]}
    assert read_back(store, 1, tmp_path / "back", step="2") == images(2)
    with pytest.raises(Exception, match="withdrawn"):
        store.reject(5, "test") and store.commit(5, {"1.0": {"kind": "image"}}, "again", 2)


# ---- garbage collection --------------------------------------------------------------------------------------
def test_finished_jobs_are_removed_by_slurms_word_and_nothing_else(tmp_path, tree):
    root = tmp_path / "images"
    staging = Staging(tmp_path / "staging")
    for job in (10, 11, 12, 13, 14):
        capture(rank_runner(JobStore(root, "c", job), staging, tree, images(job)), 1)
    capture(rank_runner(JobStore(root, "other", 10), staging, tree, images(1)), 1)
    states = {10: "COMPLETED", 11: "PENDING", 12: "CANCELLED", 13: "REQUEUE_HOLD"}      # 14: unknown
    dry = reclaim.collect_finished(root, "c", states, keep_finished=False, dry_run=True)
    assert sorted((r.kind, Path(r.path).name) for r in dry) == [("finished-job", "10"), ("finished-job", "12"),
                                                                ("kept", "14")]
    assert all(JobStore(root, "c", j).job_dir.exists() for j in (10, 12))
    kept = reclaim.collect_finished(root, "c", states, keep_finished=True)
    assert {r.kind for r in kept} == {"kept"} and JobStore(root, "c", 10).job_dir.exists()
    gone = reclaim.collect_finished(root, "c", states, keep_finished=False)
    assert sum(r.bytes for r in gone if r.kind == "finished-job") > 0
    left = sorted(p.name for p in (root / "c").iterdir() if not p.name.startswith("."))
    assert left == ["11", "13", "14"] and JobStore(root, "other", 10).job_dir.exists()


def test_staging_areas_of_dead_agents_are_orphans(tmp_path):
    staging = Staging(tmp_path / "staging")
    mine = staging.make(staging.area("c", 5, "capture", 1, "0", 0))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:2]; from slurmckpt.store.staging "
                              "import Staging; from pathlib import Path; s = Staging(Path(sys.argv[2])); "
                              "s.make(s.area('c', 6, 'restore', 2, '0', 0))",
                              str(Path(__file__).resolve().parents[3] / "src"), str(staging.root)])
    assert child.wait() == 0
    orphans = reclaim.collect_staging(staging, dry_run=True)
    assert [Path(r.path).parent.name for r in orphans] == ["c.6"]
    reclaim.collect_staging(staging)
    assert staging.areas() == [mine]


def test_an_area_being_made_is_not_taken_for_an_orphan_until_it_is_old(tmp_path):
    """Another agent's area between its mkdir and its .owner write (or with .owner still empty) is left
    alone by the node's staging collection; the same area MAKING_S later, still without an owner, goes."""
    from slurmckpt.store.staging import MAKING_S, OWNER
    staging = Staging(tmp_path / "staging")
    staging.ensure()
    bare = staging.area("c", 7, "restore", 2, "0", 0)
    bare.parent.mkdir(mode=0o700)
    bare.mkdir(mode=0o700)
    empty = staging.area("c", 7, "restore", 2, "0", 1)
    empty.mkdir(mode=0o700)
    (empty / OWNER).write_text("")
    assert reclaim.collect_staging(staging) == [] and sorted(staging.areas()) == sorted([bare, empty])
    later = time.time() + MAKING_S + 1
    assert sorted(r.path for r in reclaim.collect_staging(staging, now=later)) == sorted([str(bare), str(empty)])
    assert staging.areas() == []


@pytest.mark.system
def test_gc_command_removes_finished_jobs_and_says_what_it_did(tmp_path, tree, monkeypatch):
    root = tmp_path / "images"
    staging = Staging(tmp_path / "staging")
    for job in (20, 21):
        capture(rank_runner(JobStore(root, "c", job), staging, tree, images(job)), 1)
    FakeSlurm(scontrol="ClusterName = c\n", squeue=squeue_states({20: "COMPLETED", 21: "RUNNING"})).install(monkeypatch)
    assert settled(staging) == []
    monkeypatch.setattr(Config, "load", classmethod(lambda c, *a, **k: Config.from_mapping(
        {"storage_root": str(root), "staging_dir": str(staging.root), "freezer_root": str(tmp_path / "cgroups")})))
    r = CliRunner().invoke(cli.cli, ["gc", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert [(x["kind"], Path(x["path"]).name) for x in json.loads(r.stdout)] == [("finished-job", "20")]
    assert JobStore(root, "c", 20).job_dir.exists()
    r = CliRunner().invoke(cli.cli, ["gc"])
    assert r.exit_code == 0 and "removed" in r.output and "job COMPLETED" in r.output, r.output
    assert not JobStore(root, "c", 20).job_dir.exists() and JobStore(root, "c", 21).job_dir.exists()


@pytest.mark.system
def test_gc_removes_this_nodes_empty_task_cgroups_of_finished_jobs_only(tmp_path, monkeypatch):
    """Left when slurmstepd's final SIGKILL ended an agent with its watchdog: gc removes the empty cgroups
    of jobs Slurm says are finished, reports one that still holds a process and one of a job Slurm does
    not know, and leaves a running job's and names that are not a task's."""
    removed = fake_rmdir(monkeypatch)
    (tmp_path / "images").mkdir(mode=0o700)
    cgroups = tmp_path / "cgroups"
    for name, procs in [("30.0.1.0", ""), ("30.batch.0.1", ""), ("31.0.0.0", ""), ("32.0.0.0", "77\n"),
                        ("33.0.0.0", ""), ("not-a-task", "")]:
        (cgroups / name).mkdir(parents=True)
        (cgroups / name / "cgroup.procs").write_text(procs)
        (cgroups / name / "cgroup.freeze").write_text("1")
    states = squeue_states({30: "CANCELLED", 31: "RUNNING", 32: "COMPLETED"})
    FakeSlurm(scontrol="ClusterName = c\n", squeue=states, sacct="").install(monkeypatch)
    monkeypatch.setattr(Config, "load", classmethod(lambda c, *a, **k: Config.from_mapping(
        {"storage_root": str(tmp_path / "images"), "staging_dir": str(tmp_path / "staging"),
         "freezer_root": str(cgroups)})))
    r = CliRunner().invoke(cli.cli, ["gc", "--json"])
    assert r.exit_code == 0, r.output
    assert sorted((x["kind"], Path(x["path"]).name) for x in json.loads(r.stdout)) == [
        ("kept", "32.0.0.0"), ("kept", "33.0.0.0"), ("task-cgroup", "30.0.1.0"), ("task-cgroup", "30.batch.0.1")]
    assert sorted(removed) == ["30.0.1.0 0", "30.batch.0.1 0"]         # thawed, then removed
    assert sorted(p.name for p in cgroups.iterdir()) == ["31.0.0.0", "32.0.0.0", "33.0.0.0", "not-a-task"]


def test_job_states_ask_slurmctld_about_each_job_alone_and_accounting_only_of_jobs_it_no_longer_holds(monkeypatch):
    """gc and the job's end ask about the jobs in hand, one `squeue -j N` each (slurmctld sends that job's
    record), never the whole queue of every user (`squeue --json --all` did, at every job's end). A requeued
    job's last accounting record says PREEMPTED (or REQUEUED) until slurmdbd hears of its next run: what
    slurmctld holds decides, and accounting is never asked about it."""
    fake = FakeSlurm(squeue=squeue_states({3: "PENDING", 7: "REQUEUED", 8: "COMPLETING"}),
                     sacct="4|CANCELLED by 0\n5|COMPLETED\n7|PREEMPTED\n").install(monkeypatch)
    states = CliSlurm().job_states([3, 4, 5, 6, 7, 8])
    assert states == {3: "PENDING", 4: "CANCELLED", 5: "COMPLETED", 7: "REQUEUED", 8: "COMPLETING"}
    assert [c[c.index("-j") + 1] for c in fake.ran("squeue")] == ["3", "4", "5", "6", "7", "8"]
    assert fake.ran("sacct")[0][fake.ran("sacct")[0].index("-j") + 1] == "4,5,6"
    assert [reclaim.verdict(states[j]) for j in (3, 7, 8)] == ["runs-again", "runs-again", "settling"]


@pytest.mark.parametrize("squeue", [Ran(1, "", "slurm_load_jobs error: Socket timed out on send/recv operation"),
                                    Ran(1, "", "slurm_load_jobs error: Unable to contact slurm controller"),
                                    "squeue: error: something else\n"])
@pytest.mark.system
def test_gc_skips_the_run_when_slurmctld_does_not_answer(tmp_path, tree, monkeypatch, squeue):
    """Accounting alone once made gc delete a requeued job's store (its last record said PREEMPTED): when
    squeue fails, or answers without the job, gc removes nothing at all, says so and exits 1."""
    root = tmp_path / "images"
    staging = Staging(tmp_path / "staging")
    capture(rank_runner(JobStore(root, "c", 40), staging, tree, images(40)), 1)
    fake = FakeSlurm(scontrol="ClusterName = c\n", squeue=squeue, sacct="40|PREEMPTED\n").install(monkeypatch)
    monkeypatch.setattr(Config, "load", classmethod(lambda c, *a, **k: Config.from_mapping(
        {"storage_root": str(root), "staging_dir": str(staging.root), "freezer_root": str(tmp_path / "cgroups")})))
    r = CliRunner().invoke(cli.cli, ["gc"])
    assert r.exit_code == 1 and "skipped: nothing was removed" in r.output, r.output
    assert JobStore(root, "c", 40).committed() and not fake.ran("sacct")


def test_new_config_keys_have_defaults_and_name_the_key_when_bad():
    c = Config()
    assert (c.compression, c.compression_level, c.quota_job, c.keep_finished) == ("zstd", 1, 0, False)
    assert Config.from_mapping({"quota_user": "2GiB", "keep_finished": "yes"}).quota_user == 2 << 30
    for key, bad in [("persist_nice", 25), ("persist_io_class", "realtime"), ("staging_dir", "rel/path"),
                     ("keep_finished", "maybe"), ("compression", "lz4")]:
        with pytest.raises(Exception, match=f"key '{key}'"):
            Config.from_mapping({key: bad})
