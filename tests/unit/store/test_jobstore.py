"""Image store: commit needs every rank's complete manifest, the job manifest is replaced atomically,
keep-last-N pruning, verify catches corruption, discard never touches committed epochs."""
from __future__ import annotations

import json
import os
import stat
import time

import pytest

from slurmckpt.store import reclaim
from slurmckpt.store import jobstore
from slurmckpt.errors import StorageError
from slurmckpt.store.jobstore import JOB_MANIFEST, RANK_MANIFEST, JobStore, list_jobs
from slurmckpt.store.record import Capture


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "images", "clu", 77)
    s.ensure()
    return s


def capture(store: JobStore, epoch: int, step: str = "0", rank: int = 0, files: dict | None = None) -> dict:
    d = store.rank_dir(epoch, step, rank)
    d.mkdir(parents=True)
    for name, data in (files or {"pages-1.img": os.urandom(5000), "core-1.img": b"core"}).items():
        (d / name).write_bytes(data)
    (d / "dump.log").write_text("log, not part of the image")
    return store.write_rank_manifest(epoch, step, rank, Capture())


def test_ensure_makes_private_dirs(store):
    for d in (store.root, store.root / "clu", store.job_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert store.job_dir == store.root / "clu" / "77"
    assert store.rank_dir(3, "batch", 0) == store.job_dir / "epoch-000003" / "batch.0"


def test_rank_manifest_lists_files_with_checksums(store):
    m = capture(store, 1, files={"a.img": b"x" * 100, "b.img": b""}).to_json()
    assert set(m["files"]) == {"a.img", "b.img"}             # logs and rank.json itself excluded
    assert m["files"]["a.img"]["size"] == 100
    assert m["files"]["a.img"]["xxh3"] == jobstore.file_checksum(store.rank_dir(1, "0", 0) / "a.img")
    assert m["files"]["a.img"]["xxh3"] != m["files"]["b.img"]["xxh3"]
    on_disk = json.loads((store.rank_dir(1, "0", 0) / RANK_MANIFEST).read_text())
    assert on_disk["files"] == m["files"] and on_disk["kind"] == "image" and on_disk["epoch"] == 1


def test_commit_with_complete_ranks(store):
    capture(store, 1, "0", 0)
    capture(store, 1, "0", 1)
    m = store.commit(1, {"0.0": {"kind": "image"}, "0.1": {"kind": "image"},
                         "1.0": {"kind": "completed", "exit_code": 0}}, "interval", keep=2)
    assert [e["epoch"] for e in m["epochs"]] == [1]
    assert store.committed()[0]["ranks"]["1.0"] == {"kind": "completed", "exit_code": 0}
    assert store.committed()[0]["reason"] == "interval"
    assert store.next_epoch() == 2


def test_commit_refused_when_a_rank_manifest_is_missing(store):
    capture(store, 1, "0", 0)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    before = (store.job_dir / JOB_MANIFEST).read_bytes()
    capture(store, 2, "0", 0)
    store.rank_dir(2, "0", 1).mkdir()                    # rank 1 dumped images but never sealed
    (store.rank_dir(2, "0", 1) / "pages-1.img").write_bytes(b"partial")
    with pytest.raises(StorageError, match="incomplete"):
        store.commit(2, {"0.0": {"kind": "image"}, "0.1": {"kind": "image"}}, "interval", keep=2)
    assert (store.job_dir / JOB_MANIFEST).read_bytes() == before
    assert [e["epoch"] for e in store.committed()] == [1]


def test_commit_refused_for_replay_rank_without_manifest(store):
    with pytest.raises(StorageError):
        store.commit(1, {"batch.0": {"kind": "replay"}}, "walltime", keep=2)
    assert store.committed() == []


def test_commit_refused_for_unreadable_rank_manifest(store):
    capture(store, 1)
    (store.rank_dir(1, "0", 0) / RANK_MANIFEST).write_text("{truncated")
    with pytest.raises(StorageError, match="unreadable"):
        store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    assert not (store.job_dir / JOB_MANIFEST).exists()


def test_job_manifest_replaced_atomically(store, monkeypatch):
    """A crash while writing the new manifest (here: fsync fails) leaves the old one intact and readable."""
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    before = (store.job_dir / JOB_MANIFEST).read_bytes()
    capture(store, 2)

    def boom(fd):
        raise OSError(5, "EIO")
    monkeypatch.setattr(jobstore.os, "fsync", boom)
    with pytest.raises(StorageError, match="writing manifest.json"):
        store.commit(2, {"0.0": {"kind": "image"}}, "interval", keep=2)
    monkeypatch.undo()
    assert (store.job_dir / JOB_MANIFEST).read_bytes() == before
    assert [e["epoch"] for e in store.committed()] == [1]
    # the next successful commit still works and leaves no temporary files behind
    store.commit(2, {"0.0": {"kind": "image"}}, "interval", keep=2)
    assert [e["epoch"] for e in store.committed()] == [2, 1]
    assert stat.S_IMODE((store.job_dir / JOB_MANIFEST).stat().st_mode) == 0o600


def test_no_temporary_file_left_after_commit(store):
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    assert {p.name for p in store.job_dir.iterdir()} == {JOB_MANIFEST, "epoch-000001"}


def test_keep_last_n_prunes_oldest_after_commit(store):
    for epoch in range(1, 5):
        capture(store, epoch)
        store.commit(epoch, {"0.0": {"kind": "image"}}, "interval", keep=2)
    assert [e["epoch"] for e in store.committed()] == [4, 3]
    assert not store.epoch_dir(1).exists() and not store.epoch_dir(2).exists()
    assert store.epoch_dir(3).exists() and store.epoch_dir(4).exists()
    store.verify_rank(3, "0", 0)                        # the fallback epoch is intact
    assert store.next_epoch() == 5


def test_keep_zero_keeps_everything(store):
    for epoch in range(1, 4):
        capture(store, epoch)
        store.commit(epoch, {"0.0": {"kind": "image"}}, "interval", keep=0)
    assert [e["epoch"] for e in store.committed()] == [3, 2, 1]
    assert all(store.epoch_dir(e).exists() for e in (1, 2, 3))


def test_recommit_same_epoch_replaces_entry(store):
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    store.commit(1, {"0.0": {"kind": "image"}, "1.0": {"kind": "completed", "exit_code": 2}}, "final", keep=2)
    epochs = store.committed()
    assert len(epochs) == 1 and epochs[0]["reason"] == "final" and "1.0" in epochs[0]["ranks"]


def test_verify_accepts_intact_images(store):
    capture(store, 1)
    m = store.verify_rank(1, "0", 0)
    assert m.capture.tree.kind == "image"


def test_verify_detects_same_size_corruption(store):
    capture(store, 1, files={"pages-1.img": b"A" * 4096})
    path = store.rank_dir(1, "0", 0) / "pages-1.img"
    path.write_bytes(b"A" * 2048 + b"B" + b"A" * 2047)
    with pytest.raises(StorageError, match="pages-1.img corrupt"):
        store.verify_rank(1, "0", 0)


def test_verify_detects_truncation(store):
    capture(store, 1, files={"pages-1.img": b"A" * 4096})
    os.truncate(store.rank_dir(1, "0", 0) / "pages-1.img", 4095)
    with pytest.raises(StorageError, match="corrupt"):
        store.verify_rank(1, "0", 0)


def test_verify_detects_missing_file(store):
    capture(store, 1, files={"pages-1.img": b"p", "core-1.img": b"c"})
    (store.rank_dir(1, "0", 0) / "core-1.img").unlink()
    with pytest.raises(StorageError, match="core-1.img missing"):
        store.verify_rank(1, "0", 0)


def test_verify_detects_missing_rank_manifest(store):
    capture(store, 1)
    (store.rank_dir(1, "0", 0) / RANK_MANIFEST).unlink()
    with pytest.raises(StorageError, match="incomplete"):
        store.verify_rank(1, "0", 0)


def test_discard_never_touches_a_committed_epoch(store):
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    store.discard_epoch_rank(1, "0", 0)
    store.verify_rank(1, "0", 0)
    reclaim.collect_job(store, now=time.time() + 10 * reclaim.GRACE_S, wait=True)
    store.verify_rank(1, "0", 0)


def test_discard_removes_uncommitted_rank_and_empty_epoch(store):
    capture(store, 2, "0", 0)
    capture(store, 2, "0", 1)
    store.discard_epoch_rank(2, "0", 0)
    assert not store.rank_dir(2, "0", 0).exists()
    assert store.rank_dir(2, "0", 1).exists()           # the other rank's partial images: its own abort
    store.discard_epoch_rank(2, "0", 1)
    assert not store.epoch_dir(2).exists()


def test_uncommitted_epochs_are_collected_once_their_lease_runs_out(store):
    """An allocated epoch stays while its coordinator may still commit it (its lease), then goes; an epoch
    without a lease goes once untouched for GRACE_S; committed epochs never."""
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    leased = store.allocate_epoch(1, lease_s=600, owner="test")
    capture(store, leased)
    capture(store, 7)                                   # no lease: an older writer's leftover
    now = time.time()
    assert reclaim.collect_job(store, now=now, wait=True) == []
    gone = reclaim.collect_job(store, now=now + 601, wait=True)
    assert [(r.kind, r.path) for r in gone] == [("uncommitted-epoch", str(store.epoch_dir(leased)))]
    assert "lease ran out" in gone[0].why and gone[0].bytes > 5000
    gone = reclaim.collect_job(store, now=now + reclaim.GRACE_S + 60, wait=True)
    assert [r.path for r in gone] == [str(store.epoch_dir(7))]
    assert store.epoch_dir(1).exists() and not store.epoch_dir(leased).exists() and not store.epoch_dir(7).exists()
    assert not any(p.name.startswith(".trash-") for p in store.job_dir.iterdir())
    store.verify_rank(1, "0", 0)
    assert store.next_epoch() == 8


def test_next_epoch_skips_uncommitted_directories(store):
    capture(store, 1)
    store.commit(1, {"0.0": {"kind": "image"}}, "interval", keep=2)
    capture(store, 5)                                   # an aborted epoch left behind
    assert store.next_epoch() == 6


def test_manifest_of_another_format_version_is_refused(store):
    (store.job_dir / JOB_MANIFEST).write_text(json.dumps({"version": 99, "epochs": []}))
    with pytest.raises(StorageError, match="format version 99"):
        store.committed()
    (store.job_dir / JOB_MANIFEST).write_text("not json")
    with pytest.raises(StorageError, match="unreadable"):
        store.committed()


def test_list_jobs(tmp_path):
    JobStore(tmp_path, "a", 5).ensure()
    JobStore(tmp_path, "a", 12).ensure()
    JobStore(tmp_path, "b", 1).ensure()
    assert sorted(list_jobs(tmp_path)) == [("a", 5), ("a", 12), ("b", 1)]


def test_reject_withdraws_a_committed_epoch_and_keeps_numbers_growing(tmp_path):
    from slurmckpt.store.jobstore import JobStore
    store = JobStore(tmp_path, "c", 9)
    store.ensure()
    for epoch in (1, 2):
        store.epoch_dir(epoch).mkdir(parents=True)
        store.commit(epoch, {}, "manual", keep=3)
    assert store.reject(2, "rank 0.1 could not restore it") is True
    assert [e["epoch"] for e in store.committed()] == [1]
    assert store.read_manifest()["rejected"][0]["epoch"] == 2
    assert store.reject(2, "again") is False            # already withdrawn: nothing changes
    assert store.next_epoch() == 3                       # a withdrawn number is never reused
