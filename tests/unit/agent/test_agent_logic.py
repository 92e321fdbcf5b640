"""The root agent's decisions, with a fake channel, a fake peer and a fake tree cgroup: every request gets one
reply (errors keep their type, a bug is reported and serving goes on), nothing is done for a process that is
not the wrapper, a bad frame or the wrapper's exit ends the service and the tree; the plan offers the committed
epochs that hold this rank, newest first; a restore is refused before anything is touched. The real agent
under Slurm: tests/integration (test_security.py for a hostile wrapper)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmckpt.rank.context import Limits
from slurmckpt.config import Config
from slurmckpt.agent.epochs import EpochControl
from slurmckpt.agent.facts import TaskFacts
from slurmckpt.agent.job import JobOperations
from slurmckpt.agent.plan import TaskPlan, relay_path
from slurmckpt.agent.service import Agent
from slurmckpt.agent.tree import TaskTree
from slurmckpt.identity import TaskIdentity
from slurmckpt.errors import LockContended, PermissionDenied, ProtocolError, StorageError
from slurmckpt.store.instance import JobInstance, claim
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.store.jobstore import JobStore
from fake_runner import fake_runner


class FakeChannel:
    """The wrapper's side: `inbox` holds the requests ((message, fds) or an exception recv raises); EOF after
    the last one."""

    def __init__(self, *inbox) -> None:
        self.inbox = list(inbox)
        self.sent: list[dict] = []

    def recv(self):
        if not self.inbox:
            raise EOFError("peer closed the channel")
        item = self.inbox.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def send(self, message: dict, fds=None) -> None:
        self.sent.append(message)


class FakePeer:
    def __init__(self, gone: bool = False) -> None:
        self.pid, self.gone = 4321, gone

    def require(self) -> int:
        if self.gone:
            raise PermissionDenied("the task's wrapper has exited", pid=self.pid)
        return self.pid


class FakeTree:
    """The tree's cgroup as the agent ends it."""

    def __init__(self, path: Path, kill_fails: bool = False) -> None:
        self.path, self.kill_fails = path, kill_fails
        self.done: list[str] = []

    def kill_all(self) -> None:
        self.done.append("kill_all")
        if self.kill_fails:
            raise OSError("cgroup.kill: No such device")

    def remove(self) -> None:
        self.done.append("remove")


ME = JobInstance("c", 43, 1001, 1001, "2026-12-03T11:26:17", 1)


def assemble(ident: TaskIdentity, store: JobStore, *, config=None, channel=None, peer=None, cgroup=None,
             runner=None, instance=None, slurm_job=None, store_note=None, reporter=None) -> Agent:
    """An agent built from its parts as Agent.start builds them, nothing started: no watchdog, no drivers (a
    test that needs one sets it on the part that owns it)."""
    facts = TaskFacts(ident, config or Config(), store, instance, slurm_job, store_note, reporter=reporter)
    peer = peer or FakePeer()
    trees: list[TaskTree] = []
    plan = TaskPlan(facts, lambda: trees[0].cgroup.path / "cgroup.procs")
    tree = TaskTree(facts, plan, peer, cgroup, -1, None, None, None, Limits(), None)
    trees.append(tree)
    if runner is not None:
        tree.runner = runner
    return Agent(facts, channel or FakeChannel(), peer, plan, tree, EpochControl(facts, plan, tree),
                 JobOperations(facts))


def make_agent(tmp_path: Path, channel: FakeChannel | None = None, peer: FakePeer | None = None,
               tree: FakeTree | None = None, rank: int = 0) -> Agent:
    store = JobStore(tmp_path / "images", "c", 43)
    store.ensure()
    return assemble(TaskIdentity("c", 43, "0", rank, 1001, 1001, ME.restart_count), store, channel=channel,
                    peer=peer, cgroup=tree or FakeTree(tmp_path / "cg"),
                    runner=fake_runner(root_pid=None, killed_for=""), instance=ME,
                    slurm_job=JobRecord(43, 1001, 1001, ME.submit_time, 1, "RUNNING", {}),
                    store_note=claim(store, ME))


def request(op: str, fds: list[int] | None = None, **args) -> tuple[dict, list[int]]:
    return {"op": op, **args}, list(fds or [])


# ---- the service loop ------------------------------------------------------------------------------------
def test_each_request_gets_one_reply_its_fds_are_closed_and_the_wrappers_exit_ends_the_tree(tmp_path):
    r, w = os.pipe()
    chan = FakeChannel(request("hello", [r]), request("hello"))
    a = make_agent(tmp_path, chan)
    a.serve()
    assert [m["ok"] for m in chan.sent] == [True, True] and chan.sent[0]["job"] == 43
    with pytest.raises(OSError):
        os.fstat(r)                       # closed by the agent once handled
    os.close(w)
    assert a.tree.cgroup.done == ["kill_all", "remove"]      # nothing of the tree outlives its wrapper


def test_an_unknown_operation_is_refused_and_serving_goes_on(tmp_path):
    chan = FakeChannel(request("become_root"), request("hello"))
    make_agent(tmp_path, chan).serve()
    assert chan.sent[0] == {"ok": False, "error": "unknown operation 'become_root'", "error_type": "ProtocolError"}
    assert chan.sent[1]["ok"] is True


def test_errors_are_replied_with_their_type_and_a_bug_does_not_stop_the_agent(tmp_path):
    """A typed error crosses as its type's name (LockContended stays retryable on the wrapper's side); an
    unexpected exception is reported as SlurmckptError, and the next request is still served (an agent that
    died would leave a frozen tree to its watchdog)."""
    chan = FakeChannel(request("prepare", epoch=3), request("abort", epoch=3), request("hello"))
    a = make_agent(tmp_path, chan)

    def contended(m, fds):
        raise LockContended("GPU lock of pid 7 timed out after 500 ms", pid=7)

    def buggy(m, fds):
        raise KeyError("root_pid")
    a.operations["prepare"], a.operations["abort"] = contended, buggy
    a.serve()
    assert chan.sent[0]["error_type"] == "LockContended" and "pid=7" in chan.sent[0]["error"]
    assert chan.sent[1]["error_type"] == "SlurmckptError" and "KeyError" in chan.sent[1]["error"]
    assert chan.sent[2]["ok"] is True


def test_nothing_is_done_for_a_process_that_is_not_the_wrapper(tmp_path):
    """The wrapper exited and something else holds its socket: every request is refused before its handler."""
    chan = FakeChannel(request("abort", epoch=3))
    a = make_agent(tmp_path, chan, FakePeer(gone=True))
    ran = []
    a.operations["abort"] = lambda m, fds: ran.append(m)
    a.serve()
    assert ran == [] and chan.sent[0]["ok"] is False and chan.sent[0]["error_type"] == "PermissionDenied"


def test_a_bad_frame_ends_the_service_and_the_tree(tmp_path):
    """After a malformed frame the stream cannot be trusted: what follows it is not served."""
    chan = FakeChannel(ProtocolError("oversized frame"), request("hello"))
    a = make_agent(tmp_path, chan)
    a.serve()
    assert len(chan.sent) == 1 and chan.sent[0]["error_type"] == "ProtocolError"
    assert a.tree.cgroup.done == ["kill_all", "remove"]


def test_the_tree_cgroup_is_removed_even_when_killing_fails(tmp_path):
    a = make_agent(tmp_path, tree=FakeTree(tmp_path / "cg", kill_fails=True))
    a.serve()
    assert a.tree.cgroup.done == ["kill_all", "remove"]


# ---- what the task should do: restore, or run -----------------------------------------------------------
def commit(store: JobStore, epoch: int, ranks: dict) -> None:
    """A committed epoch in the job manifest (the images themselves are not what the plan looks at)."""
    path = store.job_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["epochs"].append({"epoch": epoch, "reason": "test", "ranks": ranks})
    path.write_text(json.dumps(manifest))


def test_plan_offers_the_epochs_that_hold_this_rank_newest_first(tmp_path):
    a = make_agent(tmp_path)
    commit(a.facts.store, 1, {"0.0": {"kind": "image"}, "0.1": {"kind": "image"}})
    commit(a.facts.store, 2, {"0.1": {"kind": "image"}})                        # this rank not in it
    commit(a.facts.store, 3, {"0.0": {"kind": "image"}, "0.1": {"kind": "completed", "exit_code": 0}})
    plan = a.plan.plan({}, [])
    assert [c["epoch"] for c in plan["candidates"]] == [3, 1] and plan["newest"] == 3
    assert plan["completed"] == {"0.1": {"kind": "completed", "exit_code": 0}}
    assert "warning" not in plan


def test_plan_offers_nothing_to_a_first_run(tmp_path):
    a = make_agent(tmp_path)
    commit(a.facts.store, 1, {"0.0": {"kind": "image"}})
    a.facts.ident = TaskIdentity("c", 43, "0", 0, 1001, 1001, 0)
    assert a.plan.plan({}, [])["candidates"] == []


def test_a_restore_is_refused_before_anything_is_touched(tmp_path):
    """Only a committed epoch, only into a task without a tree, only with the task's own stdio."""
    a = make_agent(tmp_path)
    commit(a.facts.store, 1, {"0.0": {"kind": "image"}})
    with pytest.raises(StorageError, match="epoch 2 is not a committed checkpoint"):
        a.tree.restore({"epoch": 2}, [0, 1, 2])
    a.tree.runner.root_pid = 999
    with pytest.raises(PermissionDenied, match="already running"):
        a.tree.restore({"epoch": 1}, [0, 1, 2])
    a.tree.runner.root_pid = None
    with pytest.raises(ProtocolError, match="stdio"):
        a.tree.restore({"epoch": 1}, [0, 1])
    assert a.tree.cgroup.done == [] and not (tmp_path / "cg").exists()


# ---- the SIZE phase --------------------------------------------------------------------------------------
def sizing_agent(tmp_path: Path, chan: FakeChannel, size, others: int = 0) -> tuple[Agent, int]:
    """An agent whose rank runner measures with `size` (a function of the epoch), whose tree has `others` more
    trees of the job on the node, and whose watchdog pipe is read back by the test."""
    from slurmckpt.config import Config
    from slurmckpt.store.fresh_start import FailureReporter
    from slurmckpt.identity import TreeName
    a = make_agent(tmp_path, chan)
    a.tree.cgroup.other_trees = lambda: {1000 + i: TreeName(43, "0", i + 1, 0) for i in range(others)}
    a.facts.config = Config(capture_timeout_s=60.0)
    a.tree.runner = fake_runner(root_pid=1, size=size, footprint=None, killed_for="")
    a.tree.criu = SimpleNamespace(timeout_s=60.0)
    a.facts.reporter = FailureReporter(a.facts.store, 43, "0.0", "n1", annotate=lambda job, text: "AdminComment",
                                 background=False)
    r, a.tree.watchdog_fd = os.pipe()
    return a, r


def test_size_lengthens_criu_and_watchdog_limits_from_roots_own_measurement(tmp_path):
    """100 GB of GPU state and 4 GB of host memory, one more tree of the job on the node: criu's timeout and
    the watchdog's frozen limit follow the node's disk rate, never below the configured floor."""
    from slurmckpt.rank.fit import Footprint
    from slurmckpt.cuda.interface import GpuUse

    def size(epoch):
        a.tree.runner.footprint = Footprint(4 * 10**9, GpuUse({7: {"GPU-x": 100 * 10**9}}), 2**40, None, None)
        return {"gpu_bytes": 100 * 10**9, "notes": []}
    chan = FakeChannel(request("size", epoch=3, final=False, trigger="interval"))
    a, r = sizing_agent(tmp_path, chan, size, others=1)
    a.serve()
    assert chan.sent[0]["ok"] and chan.sent[0]["gpu_bytes"] == 100 * 10**9
    expect = 2 * (2 * 104 / 1.6 + 2 * 104 / 1.6)     # two trees' images through one disk, then read back
    assert a.tree.criu.timeout_s == pytest.approx(expect)
    assert os.read(r, 100) == f"limit {expect + 120:.0f}\n".encode()


def test_a_size_refusal_is_replied_with_its_stage_and_recorded(tmp_path):
    from slurmckpt.errors import CaptureError
    from slurmckpt.store.fresh_start import failures

    def size(epoch):
        a.tree.runner.stage_failed("size")
        raise CaptureError("capture refused before anything was locked: the GPU checkpoint copies 9.0 GiB ...")
    chan = FakeChannel(request("size", epoch=3, final=True, trigger="sigterm"))
    a, r = sizing_agent(tmp_path, chan, size)
    a.serve()
    assert chan.sent[0]["ok"] is False and chan.sent[0]["stage"] == "size"
    assert chan.sent[0]["error_type"] == "CaptureError"
    (failure,) = failures(a.facts.store)
    assert (failure.epoch, failure.stage, failure.final, failure.trigger) == (3, "size", True, "sigterm")
    assert a.tree.criu.timeout_s == 60.0        # nothing measured: the limits stay


def test_epoch_numbers_for_the_coordinator_are_unique_and_leased(tmp_path):
    """allocate_epoch: above every number the store has seen and at least what the coordinator asks; its
    directory carries a lease covering every phase the epoch may still take; a bad request is refused."""
    from slurmckpt.config import Config
    a = make_agent(tmp_path, FakeChannel(request("allocate_epoch", at_least=1), request("allocate_epoch", at_least=1),
                                         request("allocate_epoch", at_least=40),
                                         request("allocate_epoch", at_least="7; rm -rf /")))
    a.facts.config = Config.from_mapping({"prepare_timeout_s": 10, "capture_timeout_s": 20, "persist_timeout_s": 30})
    a.serve()
    assert [m.get("epoch") for m in a.channel.sent[:3]] == [1, 2, 40]
    assert a.channel.sent[3]["ok"] is False and a.channel.sent[3]["error_type"] == "ProtocolError"
    lease = json.loads((a.facts.store.epoch_dir(40) / ".lease").read_text())
    import time
    assert 10 + 20 + 30 < lease["expires_at"] - time.time() <= 10 + 20 + 30 + 120


# ---- a step whose srun the batch wrapper ran again for a restored MPI launcher (srun_relay.py) ----------------
def rank_record(store: JobStore, epoch: int, name: str, **fields) -> None:
    step, rank = name.split(".")
    rdir = store.rank_dir(epoch, step, int(rank))
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "rank.json").write_text(json.dumps({"kind": "image", "files": {}, **fields}))


def test_a_relayed_srun_step_takes_the_name_of_the_step_whose_record_holds_its_token(tmp_path):
    """Slurm gave the step id 0; the newest epoch holding the token at this rank named it 1: the plan offers
    step 1's epochs and answers step 1, and later captures and failure reports use that name."""
    a = make_agent(tmp_path)
    a.facts.reporter = SimpleNamespace(rank="0.0")
    commit(a.facts.store, 1, {"0.0": {"kind": "completed", "exit_code": 0}, "1.0": {"kind": "image"}})
    rank_record(a.facts.store, 1, "1.0", step_token="0123456789abcdef")
    plan = a.plan.plan({"token": "0123456789abcdef"}, [])
    assert plan["step"] == "1" and [c["epoch"] for c in plan["candidates"]] == [1]
    assert a.plan.step == "1" and a.plan.step_token == "0123456789abcdef" and a.facts.reporter.rank == "1.0"


@pytest.mark.system
def test_an_unknown_token_restores_nothing_and_a_malformed_one_is_ignored(tmp_path):
    """A token no epoch holds: its step id names nothing, so nothing is restored by it (not the completed
    step 0 of the earlier run). A token that is not 16 hex digits is not used at all; the batch step never
    takes another name."""
    a = make_agent(tmp_path)
    a.facts.reporter = SimpleNamespace(rank="0.0")
    commit(a.facts.store, 1, {"0.0": {"kind": "image"}, "1.0": {"kind": "image"}})
    rank_record(a.facts.store, 1, "1.0", step_token="0123456789abcdef")
    plan = a.plan.plan({"token": "fedcba9876543210"}, [])
    assert plan["candidates"] == [] and plan["step"] == "0"
    (tmp_path / "b").mkdir(); (tmp_path / "c").mkdir()
    b = make_agent(tmp_path / "b")
    b.facts.reporter = SimpleNamespace(rank="0.0")
    commit(b.facts.store, 1, {"0.0": {"kind": "image"}})
    for bad in ("../../etc", "0123456789ABCDEF", 7, ["0123456789abcdef"]):
        plan = b.plan.plan({"token": bad}, [])
        assert [c["epoch"] for c in plan["candidates"]] == [1] and plan["step"] == "0"
        assert b.plan.step_token == ""
    c = make_agent(tmp_path / "c")
    c.facts.ident = TaskIdentity("c", 43, "batch", 0, 1001, 1001, ME.restart_count)
    c.plan.step = "batch"
    c.facts.reporter = SimpleNamespace(rank="batch.0", failed_since=lambda epoch: None)
    c.facts.config = Config(run_dir=str(tmp_path / "run"))
    c.plan.srun_relay = relay_path(c.facts.config, c.facts.ident)
    commit(c.facts.store, 1, {"batch.0": {"kind": "image"}, "1.0": {"kind": "image"}})
    rank_record(c.facts.store, 1, "1.0", step_token="0123456789abcdef")
    plan = c.plan.plan({"token": "0123456789abcdef"}, [])
    assert plan["step"] == "batch"
    assert plan["srun_relay"] == str(tmp_path / "run" / "srun-relay" / "1001" / "43")     # the batch step's relay
    assert "srun_relay" not in b.plan.plan({}, [])


def test_a_stand_in_socket_must_be_a_unix_stream_socket_and_a_restore_needs_one_per_stand_in(tmp_path):
    """srun_standin takes exactly one fd, a unix stream socket, and keeps only its inode; a restore's fds are
    the stdio (and the script) followed by exactly `standins` sockets."""
    a = make_agent(tmp_path)
    r, w = os.pipe()
    with pytest.raises(ProtocolError):
        a.tree.srun_standin({}, [r])
    with pytest.raises(ProtocolError):
        a.tree.srun_standin({}, [])
    s1, s2 = socket.socketpair()
    assert a.tree.srun_standin({}, [s1.fileno()])["ino"] == os.fstat(s1.fileno()).st_ino
    assert a.tree.handovers.standin_inos == {os.fstat(s1.fileno()).st_ino}
    commit(a.facts.store, 1, {"0.0": {"kind": "image"}})
    for standins, fds in ((2, [0, 1, 2, r]), (-1, [0, 1, 2]), ("1", [0, 1, 2, r]), (1, [0, 1, 2, r, w, r]), (True, [0, 1, 2, r])):
        with pytest.raises(ProtocolError, match="srun stand-in"):
            a.tree.restore({"epoch": 1, "standins": standins}, fds)
    assert a.tree.cgroup.done == []
    for fd in (r, w):
        os.close(fd)
    s1.close(), s2.close()
