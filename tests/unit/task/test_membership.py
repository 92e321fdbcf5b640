"""task/membership.py, a rank's membership in its job's coordinator, against the real Coordinator on loopback
(test_coordinator.Job): joining through the agent's address lookup, an epoch abandoned when its coordinator
is lost in the middle of it (the tree is thawed here, by the agent's abort, before anything else), and the
reconnection to the coordinator that replaces it, which goes on above every epoch the rank has seen."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest

from slurmckpt.config import Config
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.env import TaskEnv
from slurmckpt.task.membership import Membership
from test_coordinator import Committer, Job, wait_for

ENV = TaskEnv(job_id=7, step="0", rank=0, restart_count=0, interval_s=0, agent_fd=None, argv0=None,
              node="node1", tasks=1)


class Rank:
    """The wrapper's side of a rank that hosts nothing: its agent (the address lookup, the phases it runs)
    and the lines it says to the job's stderr."""

    def __init__(self, job: Job, abort_fails: bool = False) -> None:
        self.address: dict[str, Any] = {"found": True, "host": "127.0.0.1", "port": job.port, "token": job.token}
        self.ran: list[tuple[str, int]] = []
        self.said: list[str] = []
        self.abort_fails = abort_fails
        self.scopes: list[str] = []              # whose coordinator the rank asked its agent for
        self.on_capture = threading.Event()        # set: the capture waits here (the coordinator dies meanwhile)
        self.member = Membership(ENV, Config(), self.call, self.handle, self.said.append)
        self.member.reconnect_poll_s = 0.05

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict[str, Any]:
        assert op == "lookup_coordinator", op
        self.scopes.append(str(args["scope"]))
        return dict(self.address)

    def handle(self, kind: str, epoch: int, message: dict[str, Any]) -> dict[str, Any]:
        self.ran.append((kind, epoch))
        if kind == "abort" and self.abort_fails:
            raise SlurmckptError("thaw failed: cgroup.freeze: No such device")
        if kind == "capture":
            self.on_capture.wait(10)
            return {"kind": "image", "bytes": 10}
        return {"bytes": 10} if kind == "resume" else {}

    def join(self) -> None:
        self.member.join({"next_epoch": 1}, None)
        assert self.member.connected


@pytest.fixture
def jobs():
    made: list[Job] = []
    yield made
    for j in made:
        try:
            j.close()
        except Exception:  # noqa: BLE001 - a coordinator the test stopped already
            pass


def _lost_mid_epoch(jobs: list[Job], rank: Rank) -> int:
    """A coordinator that dies while this rank is inside CAPTURE: returns the epoch."""
    job = jobs[0]
    result: dict[str, Any] = {}
    threading.Thread(target=lambda: result.update(job.epoch("interval")), daemon=True).start()
    wait_for(lambda: ("capture", 1) in rank.ran)
    job.loop.run(job.coord.stop())              # the coordinator process is gone
    rank.on_capture.set()
    return 1


def test_an_epoch_open_when_the_coordinator_is_lost_is_aborted_here_then_the_rank_reconnects(jobs) -> None:
    jobs.append(Job(Committer()))
    rank = Rank(jobs[0])
    rank.join()
    wait_for(lambda: ENV.rank_name in jobs[0].coord.ranks)
    epoch = _lost_mid_epoch(jobs, rank)
    wait_for(lambda: ("abort", epoch) in rank.ran)
    assert [k for k, _ in rank.ran] == ["prepare", "capture", "abort"]        # thawed here, nothing resumed
    wait_for(lambda: any("lost the job's coordinator" in line for line in rank.said))
    assert any(f"epoch {epoch} abandoned (its coordinator was lost mid-epoch)" in line for line in rank.said)

    jobs.append(Job(Committer()))                # the hosting wrapper started a new one and published it
    rank.address.update(port=jobs[1].port, token=jobs[1].token)
    wait_for(lambda: ENV.rank_name in jobs[1].coord.ranks)
    # the coordinator lists the rank on its hello; the rank says so once the answer is back, a moment later
    wait_for(lambda: any(f"reconnected to the job's coordinator at 127.0.0.1:{jobs[1].port}" in line
                         for line in rank.said))
    assert jobs[1].coord.next_epoch > epoch      # the new coordinator never reuses an epoch this rank saw
    assert rank.member.open_epoch is None and set(rank.scopes) == {"job"}
    rank.member.stop()


def test_a_coordinator_lost_between_epochs_aborts_nothing(jobs) -> None:
    jobs.append(Job(Committer()))
    rank = Rank(jobs[0])
    rank.join()
    wait_for(lambda: ENV.rank_name in jobs[0].coord.ranks)
    rank.on_capture.set()
    assert jobs[0].epoch("interval")["status"] == "committed"
    jobs[0].loop.run(jobs[0].coord.stop())
    wait_for(lambda: any("lost the job's coordinator" in line for line in rank.said))
    assert "abort" not in [k for k, _ in rank.ran] and not any("abandoned" in line for line in rank.said)
    rank.member.stop()


def test_an_abandoned_epoch_whose_undo_fails_says_so_and_the_rank_still_reconnects(jobs) -> None:
    jobs.append(Job(Committer()))
    rank = Rank(jobs[0], abort_fails=True)
    rank.join()
    wait_for(lambda: ENV.rank_name in jobs[0].coord.ranks)
    epoch = _lost_mid_epoch(jobs, rank)
    wait_for(lambda: any(f"epoch {epoch} abandoned, but undoing it failed: thaw failed" in line
                         for line in rank.said))
    jobs.append(Job(Committer()))
    rank.address.update(port=jobs[1].port, token=jobs[1].token)
    wait_for(lambda: ENV.rank_name in jobs[1].coord.ranks)
    rank.member.stop()


def test_a_rank_whose_job_has_no_coordinator_runs_without_checkpoints(jobs) -> None:
    jobs.append(Job(Committer()))
    rank = Rank(jobs[0])
    rank.member.env = dataclasses.replace(ENV, rank=1, tasks=2)     # rank 0 of the step would host one
    rank.address = {"found": False}
    rank.member.join({"next_epoch": 1}, None)
    assert not rank.member.connected
    assert rank.said == ["no coordinator found: this task runs without checkpoints"]
    assert rank.scopes == ["job", "0"]           # the job's, then a stand-alone step's (hosted by its rank 0)
