"""Commits fenced by the run (storage.py), on the store harness: real staging, persist and store, CRIU and
the cgroup stood in for."""
from __future__ import annotations

from pathlib import Path

import pytest

from slurmckpt.errors import StorageError
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from store_harness import Tree, images, rank_runner, read_back


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def take(p, epoch: int, run: int, keep: int = 2) -> dict:
    """One periodic epoch of run `run` (the agent's restart count), committed by that run's agent."""
    p.prepare(epoch)
    p.capture(epoch, final=False)
    p.resume(epoch)
    return p.ctx.store.commit(epoch, {"batch.0": {"kind": "image"}}, "interval", keep=keep, run=run)


def test_a_late_commit_of_an_older_run_is_refused_and_prunes_nothing(tmp_path: Path, tree) -> None:
    """Run 0 is cut off from slurmctld (its node failed), the job is requeued and run 1 starts and commits.
    Run 0's agents still live and finish an epoch they had allocated: its commit must not become the newest
    checkpoint, nor prune run 1's (keep_epochs 2) through keep-N."""
    store, staging = JobStore(tmp_path / "images", "c", 7), Staging(tmp_path / "staging")
    old, new = rank_runner(store, staging, tree, images(1)), rank_runner(store, staging, tree, images(2))
    assert store.enter_run(0) == 0
    take(old, store.allocate_epoch(1, 600, "run 0", run=0), run=0)
    late = store.allocate_epoch(1, 600, "run 0", run=0)          # allocated before the node was lost
    assert store.enter_run(1) == 1                                # the requeued run's first agent starts
    assert store.enter_run(0) == 1, "an old run's agent starting late does not move the store back"
    first = store.allocate_epoch(1, 600, "run 1", run=1)
    take(new, first, run=1)
    second = store.allocate_epoch(1, 600, "run 1", run=1)
    take(new, second, run=1)
    old.prepare(late)
    old.capture(late, final=False)
    old.resume(late)
    with pytest.raises(StorageError, match="commit refused: this is run 0 of the job .* run 1 has started since"):
        store.commit(late, {"batch.0": {"kind": "image"}}, "interval", keep=2, run=0)
    assert [e["epoch"] for e in store.committed()] == [second, first]
    assert read_back(store, second, tmp_path / "back") == images(2)
    with pytest.raises(StorageError, match="a new epoch refused: this is run 0"):
        store.allocate_epoch(1, 600, "run 0", run=0)
    assert [e.get("run") for e in store.committed()] == [1, 1]


def test_the_agent_commits_and_allocates_as_its_own_run(tmp_path: Path) -> None:
    from test_agent_logic import ME, FakeChannel, make_agent, request
    a = make_agent(tmp_path, FakeChannel(request("allocate_epoch", at_least=1)))
    from slurmckpt.config import Config
    a.facts.config = Config.from_mapping({})
    a.facts.store.enter_run(ME.restart_count + 1)                 # a later run of the job has started
    a.serve()
    assert a.channel.sent[0]["ok"] is False and "run 2 has started since" in a.channel.sent[0]["error"]
    with pytest.raises(StorageError, match="commit refused"):
        a.job.commit({"epoch": 1, "ranks": {"batch.0": {"kind": "completed", "exit_code": 0, "node": "n1"}},
                     "reason": "interval"}, [])
    assert a.facts.store.committed() == []

