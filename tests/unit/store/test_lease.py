"""Leases that follow the epoch's work (lease.py): extended by a rank's bytes in PREPARE, renewed while it
persists, on the store harness (real staging, persist and store; CRIU and the cgroup stood in for)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurmckpt.rank import fit
from slurmckpt.store import space
from slurmckpt.store import reclaim
from slurmckpt.store import lease
from slurmckpt.store import persist
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from store_harness import Tree, images, rank_runner, read_back


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def test_a_long_persist_keeps_its_epoch_leased(tmp_path: Path, tree, monkeypatch) -> None:
    """A persist that outlasts the lease its epoch was allocated with (a large epoch, a slow store, bounded
    priority): garbage collection at any agent start meanwhile used to take the epoch mid-persist. Now the
    lease is renewed while the persist runs (here: an hour of fake time, gc every ten minutes)."""
    now = [10_000.0]
    monkeypatch.setattr(lease, "clock", lambda: now[0])
    monkeypatch.setattr(lease, "RENEW_EVERY_S", 0.01)
    store, staging = JobStore(tmp_path / "images", "c", 8), Staging(tmp_path / "staging")
    p = rank_runner(store, staging, tree, images(3))
    epoch = store.allocate_epoch(1, lease_s=60, owner="coordinator")
    real, collected = persist._store_file, []

    def slow_store(*args, **kwargs):
        for _ in range(6):
            now[0] += 600
            time.sleep(0.05)                            # the keeper renews meanwhile
            collected.extend(reclaim.collect_job(store, now=now[0], wait=True))
        return real(*args, **kwargs)
    monkeypatch.setattr(persist, "_store_file", slow_store)
    p.prepare(epoch)
    p.capture(epoch, final=False)
    p.resume(epoch)
    assert collected == [], f"gc took the epoch mid-persist: {collected}"
    store.commit(epoch, {"batch.0": {"kind": "image"}}, "interval", keep=2)
    assert read_back(store, epoch, tmp_path / "back") == images(3)


def test_prepare_extends_the_lease_to_the_epochs_bytes(tmp_path: Path, tree, monkeypatch) -> None:
    """The lease given at allocation covers the configured limits; a rank of 100 GiB dumps and seals for
    longer (the coordinator's timeouts scale with the bytes): its PREPARE extends the lease by as much."""
    now = [10_000.0]
    monkeypatch.setattr(lease, "clock", lambda: now[0])
    monkeypatch.setattr(fit, "tree_memory", lambda pids: 100 << 30)
    monkeypatch.setattr(space, "free_bytes", lambda path: 1 << 50)
    store, staging = JobStore(tmp_path / "images", "c", 9), Staging(tmp_path / "staging")
    p = rank_runner(store, staging, tree, images(4))
    epoch = store.allocate_epoch(1, lease_s=p.ctx.policy.lease_s, owner="coordinator")
    allocated = lease.expiry(store.epoch_dir(epoch))
    p.prepare(epoch)
    assert lease.expiry(store.epoch_dir(epoch)) - allocated > 300       # 2 x (107 s dump + 67 s seal)
    assert reclaim.collect_job(store, now=allocated + 60, wait=True) == []
    p.abort(epoch)


def test_a_rank_preparing_an_epoch_another_rank_withdrew_is_a_retryable_round_not_news(tmp_path):
    """Another rank's abort of the round took the epoch's directory (its last images went with it) while this
    rank was still in PREPARE: the lease extension fails typed EpochGone, which the coordinator retries with
    a new epoch and the rank's client logs below the job's output (seen: every retried PMI lock round)."""
    from slurmckpt.errors import EpochGone, is_retryable
    store = JobStore(tmp_path, "c", 7)
    store.ensure()
    epoch = store.allocate_epoch(1, 60.0, "host:1")
    store.discard_epoch_rank(epoch, "0", 0)          # the other rank's abort: nothing left, the directory goes
    with pytest.raises(EpochGone) as e:
        lease.extend(store, epoch, "0.1", lease.clock() + 600)
    assert is_retryable(e.value) and "withdrawn by an abort" in str(e.value)
