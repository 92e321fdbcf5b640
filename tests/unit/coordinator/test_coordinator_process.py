"""The coordinator as its own process (coordinator.host) under its supervisor: epochs run through it, and
when it is killed a new one starts, ranks reconnect, and epoch numbers go on without reuse."""
from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from slurmckpt.config import Config
from slurmckpt.coordinator.client import RankClient
from slurmckpt.coordinator.protocol import new_token
from slurmckpt.coordinator.supervisor import CoordinatorSupervisor, HostCallbacks
from slurmckpt.errors import ConfigError

TIMEOUT = 20


class Wrapper:
    """Stands in for the hosting wrapper: records what the supervisor reports."""

    def __init__(self, fail_commit: str | None = None, fail_allocate: str | None = None) -> None:
        self.commits: list[int] = []
        self.allocated: list[int] = []
        self.fail_allocate = fail_allocate
        self.published: list[int] = []
        self.results: queue.Queue = queue.Queue()
        self.said: list[str] = []
        self.fail_commit = fail_commit

    def commit(self, epoch: int, ranks: dict, reason: str, final: bool = False) -> None:
        if self.fail_commit:
            raise OSError(self.fail_commit)
        self.commits.append(epoch)

    def allocate(self, at_least: int, final: bool = False) -> int:
        """Like the store: above every number handed out, and at least what the coordinator asks."""
        if self.fail_allocate:
            raise OSError(self.fail_allocate)
        self.allocated.append(max([at_least, *(n + 1 for n in self.allocated)]))
        return self.allocated[-1]

    def callbacks(self) -> HostCallbacks:
        return HostCallbacks(commit=self.commit, allocate=self.allocate, publish=self.published.append, started=lambda r, a: None,
                             result=lambda result, reason, final: self.results.put(result),
                             say=self.said.append)


def rank(port: int, token: str, commands: list, last_epoch: int = 0, interval: int = 0) -> RankClient:
    def handler(kind: str, epoch: int, message: dict) -> dict:
        commands.append((kind, epoch))
        return {"kind": "image"} if kind == "capture" else {}
    client = RankClient("127.0.0.1", port, token, "batch.0", "n1", interval, handler, 1, last_epoch)
    threading.Thread(target=client.serve_forever, daemon=True).start()
    return client


def supervised(wrapper: Wrapper, next_epoch: int) -> tuple[CoordinatorSupervisor, str, int]:
    token = new_token()
    sup = CoordinatorSupervisor(7, {"token": token, "next_epoch": next_epoch, "completed": {},
                                    "prepare_timeout_s": 10, "capture_timeout_s": 10, "lock_rounds": 1},
                                wrapper.callbacks())
    return sup, token, sup.start()


def shut(sup: CoordinatorSupervisor) -> None:
    sup.stop()
    if sup.proc and sup.proc.poll() is None:
        sup.proc.kill()
        sup.proc.wait()


@pytest.fixture
def hosted():
    wrapper = Wrapper()
    sup, token, port = supervised(wrapper, 5)
    yield sup, wrapper, token, port
    shut(sup)


def test_epoch_runs_through_the_coordinator_process_and_commits_via_the_wrapper(hosted):
    sup, wrapper, token, port = hosted
    commands: list = []
    client = rank(port, token, commands)
    sup.trigger("manual", False)
    result = wrapper.results.get(timeout=TIMEOUT)
    assert result["status"] == "committed" and result["epoch"] == 5
    assert wrapper.commits == [5]
    assert [k for k, _ in commands] == ["prepare", "capture", "resume"]
    assert wrapper.published == [port]
    client.close()


def test_failed_commit_through_the_link_aborts_the_epoch():
    wrapper = Wrapper(fail_commit="disk full")
    sup, token, port = supervised(wrapper, 1)
    try:
        rank(port, token, [])
        sup.trigger("manual", False)
        result = wrapper.results.get(timeout=TIMEOUT)
        assert result["status"] == "aborted" and result["stage"] == "commit" and "disk full" in result["error"]
    finally:
        shut(sup)


def test_epoch_numbers_come_from_the_hosting_agent_and_a_refusal_freezes_nothing():
    """The coordinator asks its wrapper's agent for each epoch number (unique across the job's steps and
    coordinators: storage.allocate_epoch); when the store cannot give one, no rank gets any command."""
    wrapper = Wrapper()
    wrapper.allocated = [41]                        # another step's coordinator already ran epoch 41
    sup, token, port = supervised(wrapper, 1)
    try:
        commands: list = []
        rank(port, token, commands)
        sup.trigger("manual", False)
        result = wrapper.results.get(timeout=TIMEOUT)
        assert result["status"] == "committed" and result["epoch"] == 42 and wrapper.commits == [42]
        assert {e for _, e in commands} == {42}
        wrapper.fail_allocate = "store unreachable"
        commands.clear()
        sup.trigger("manual", False)
        result = wrapper.results.get(timeout=TIMEOUT)
        assert result["status"] == "aborted" and result["stage"] == "allocate"
        assert "store unreachable" in result["error"] and commands == []
    finally:
        shut(sup)


def test_killed_coordinator_is_replaced_and_epochs_never_reuse_a_number(hosted):
    sup, wrapper, token, port = hosted
    commands: list = []
    client = rank(port, token, commands)
    sup.trigger("manual", False)
    assert wrapper.results.get(timeout=TIMEOUT)["epoch"] == 5
    old = sup.proc
    old.send_signal(signal.SIGKILL)
    sup.reaped(old.pid, old.wait())                 # the wrapper's reaper does this for real
    deadline = time.monotonic() + TIMEOUT
    while len(wrapper.published) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(wrapper.published) == 2, wrapper.said
    assert any("died (signal 9)" in s for s in wrapper.said)
    assert sup.proc is not old and sup.proc.poll() is None
    client.closed.wait(TIMEOUT)                    # the old connection is gone with the old process
    assert client.closed.is_set()
    # the rank rejoins and names its last epoch; the new coordinator goes on after it
    sup.last_epoch = 0                              # even if the wrapper had lost track, the hello decides
    client = rank(wrapper.published[-1], token, commands, last_epoch=5)
    sup.trigger("manual", False)
    result = wrapper.results.get(timeout=TIMEOUT)
    assert result["status"] == "committed" and result["epoch"] == 6
    assert wrapper.commits == [5, 6]
    client.close()


def test_coordinator_that_keeps_dying_is_not_restarted_forever(hosted, monkeypatch):
    sup, wrapper, token, port = hosted
    monkeypatch.setattr("slurmckpt.coordinator.supervisor.RESTARTS_PER_10_MIN", 1)
    for expected_publishes in (2, None):
        proc = sup.proc
        proc.send_signal(signal.SIGKILL)
        sup.reaped(proc.pid, proc.wait())
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not (
                len(wrapper.published) == expected_publishes if expected_publishes
                else any("not restarting" in s for s in wrapper.said)):
            time.sleep(0.05)
    assert len(wrapper.published) == 2
    assert any("not restarting" in s for s in wrapper.said)


def test_coordinator_ignores_the_jobs_sigterm(hosted):
    """Slurm SIGTERMs every process of the step at preemption: the coordinator must outlive it."""
    sup, wrapper, token, port = hosted
    os.kill(sup.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert sup.proc.poll() is None


@pytest.mark.parametrize("value", ["freeze", "freeze:", "freeze:x", ":5", "dump:-1", "dump:nan"])
def test_debug_stall_after_rejects_bad_values(value):
    with pytest.raises(ConfigError, match="debug_stall_after"):
        Config(debug_stall_after=value).stall()


def test_debug_stall_after_parses():
    assert Config(debug_stall_after="dump:2.5").stall() == ("dump", 2.5)
    assert Config().stall() is None


def test_withdrawn_epoch_stops_every_later_capture(hosted):
    """A rank that could not restore says so: the ranks now run at no common cut, nothing may commit; at
    Slurm's SIGTERM every rank is told to pass it on (no final capture will be taken)."""
    sup, wrapper, token, port = hosted
    commands: list = []
    client = rank(port, token, commands)
    client.event("withdrawn", epoch=4)
    time.sleep(0.3)
    for final in (False, True):
        sup.trigger("sigterm" if final else "manual", final)
        result = wrapper.results.get(timeout=TIMEOUT)
        assert result["status"] == "skipped" and "could not restore epoch 4" in result["why"]
    assert [k for k, _ in commands] == ["pass-sigterm"] and wrapper.commits == []
    client.close()


def test_the_coordinator_process_runs_the_interval_timer_itself(hosted):
    """A rank that asks for a 1 s interval gets periodic epochs started by the coordinator process, with no
    trigger from the wrapper; each is committed through the wrapper, one at a time."""
    sup, wrapper, token, port = hosted
    commands: list = []
    client = rank(port, token, commands, interval=1)
    try:
        first, second = wrapper.results.get(timeout=TIMEOUT), wrapper.results.get(timeout=TIMEOUT)
    finally:
        client.close()
    assert (first["status"], second["status"]) == ("committed", "committed"), (first, second)
    assert wrapper.commits == [5, 6]
    assert [c for c in commands if c[0] == "prepare"] == [("prepare", 5), ("prepare", 6)]


def test_a_word_to_a_wrapper_that_is_gone_ends_the_host_quietly():
    """The job's step ends while the host has an epoch's word on its way: the write to the closed link fails
    (EPIPE) before the link's end is read. The host ends as if it had read the end, without a traceback
    (its stderr is the job's output), and later words are dropped, not written."""
    import asyncio
    import json
    import socket
    from slurmckpt.coordinator.host import Host

    async def scenario() -> None:
        ours, wrappers = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        host = Host(reader, writer)
        wrappers.sendall(json.dumps({"token": new_token(), "next_epoch": 1, "prepare_timeout_s": 5,
                                     "capture_timeout_s": 5}).encode() + b"\n")
        running = asyncio.ensure_future(host.run())
        wrappers.setblocking(False)
        while b"listening" not in (await asyncio.get_running_loop().sock_recv(wrappers, 4096)):
            pass
        wrappers.close()
        host.send({"op": "started", "rank": "batch.0", "action": "capture"})     # EPIPE, before the EOF
        await asyncio.wait_for(running, TIMEOUT)
        assert writer.is_closing()
        host.send({"op": "result"})                                             # dropped

    asyncio.run(scenario())
