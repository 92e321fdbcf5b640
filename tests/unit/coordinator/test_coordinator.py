"""The real Coordinator on loopback, ranks = real RankClient connections served by threads."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from slurmckpt.coordinator import connection, phase
from slurmckpt.coordinator.client import RankClient
from slurmckpt.coordinator.protocol import (MAX_LINE, VERSION, LineReader, Sealer, encode_prefix, new_token,
                                            parse_line)
from slurmckpt.coordinator.server import Coordinator
from slurmckpt.cuda.stage import GpuUnsupportedError
from slurmckpt.errors import LockContended, ProtocolError, SlurmckptError

TIMEOUT = 10


class Loop:
    """An asyncio loop in a thread, where the coordinator lives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Committer:
    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[int, dict, str]] = []
        self.fail = fail

    def __call__(self, epoch: int, records: dict, reason: str, final: bool = False) -> None:
        self.calls.append((epoch, records, reason))
        self.final = final
        if self.fail:
            raise self.fail


class Job:
    def __init__(self, committer: Committer, **kw) -> None:
        self.loop = Loop()
        self.token = new_token()
        self.committer = committer

        async def make():
            c = Coordinator(self.token, committer, next_epoch=1, **kw)
            return c, await c.start("127.0.0.1", 0)
        self.coord, self.port = self.loop.run(make())
        self.ranks: list[FakeRank] = []

    def rank(self, name: str, **kw) -> "FakeRank":
        r = FakeRank(self, name, **kw)
        self.ranks.append(r)
        wait_for(lambda: name in self.coord.ranks)
        return r

    def epoch(self, reason: str = "test", final: bool = False) -> dict:
        return self.loop.run(self.coord.run_epoch(reason, final), timeout=30)

    def close(self) -> None:
        for r in self.ranks:
            r.client.close()
        self.loop.run(self.coord.stop())
        self.loop.close()


class FakeRank:
    """A rank's handler: records the commands it got, fails or disconnects on request."""

    def __init__(self, job: Job, name: str, fail: str | None = None, vanish: str | None = None,
                 block: str | None = None, slow: str | None = None, vanish_after: str | None = None,
                 node: str | None = None, sized: dict | None = None, gpus: bool = False) -> None:
        self.name, self.fail, self.vanish = name, fail, vanish
        self.slow, self.vanish_after, self.sized = slow, vanish_after, sized or {}
        self.got: list[tuple[str, int]] = []
        self.messages: list[dict] = []
        self.client = RankClient("127.0.0.1", job.port, job.token, name, node or "node-" + name, 0, self.handle,
                                 gpus=gpus)
        self.thread = threading.Thread(target=self.client.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, kind: str, epoch: int, message: dict | None = None) -> dict:
        self.got.append((kind, epoch))
        self.messages.append(dict(message or {}))
        if kind == self.vanish:
            self.client.close()
            raise ConnectionError("gone")
        if kind == self.fail:
            raise RuntimeError(f"{kind} broke")
        if kind == self.slow:
            time.sleep(0.5)
        if kind == self.vanish_after:          # reply first, then leave before the next phase
            threading.Timer(0.1, self.client.close).start()
        if kind == "size":
            return dict(self.sized)
        if kind == "capture":
            return {"kind": "image", "bytes": 1000 if (message or {}).get("final") else 0}
        if kind == "resume":
            return {"bytes": 1000}       # a periodic capture is sealed after the thaw
        return {}

    def commands(self) -> list[str]:
        return [k for k, _ in self.got]


def wait_for(pred, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.fixture
def job():
    j = Job(Committer())
    yield j
    j.close()


# ---- epochs ------------------------------------------------------------------------------------------------
def test_one_rank_epoch_commits(job):
    r = job.rank("0.0")
    res = job.epoch("interval")
    assert res["status"] == "committed", res
    assert res["epoch"] == 1 and res["ranks"] == 1 and res["bytes"] == 1000
    assert 0 <= res["cut_s"] <= res["commit_s"] <= res["total_s"]
    assert job.committer.calls == [(1, {"0.0": {"kind": "image", "node": "node-0.0"}}, "interval")]
    assert r.got == [("prepare", 1), ("capture", 1), ("resume", 1)]      # no GPUs: no SIZE round trip
    assert job.epoch()["epoch"] == 2
    assert job.coord.history[-1]["status"] == "committed"


def test_a_final_epoch_is_sized_with_the_age_of_its_trigger_and_handed_over(job):
    """Every rank judges in SIZE whether its final capture fits in what is left of Slurm's window
    (agent/window.py): SIZE runs for a final epoch of a job without GPUs too, carrying how long ago the trigger
    reached the coordinator; a periodic epoch of such a job skips SIZE. The result says the epoch is being
    persisted, not committed."""
    r = job.rank("0.0")
    assert job.epoch("interval")["status"] == "committed" and "size" not in r.commands()
    res = job.epoch("sigterm", final=True)
    assert res["status"] == "committed" and res["persisting"] is True and job.committer.final is True
    sized = next(m for (k, _), m in zip(r.got, r.messages) if k == "size")
    assert sized["final"] is True and sized["trigger"] == "sigterm" and 0 <= sized["trigger_age_s"] < 5


def test_final_epoch_finishes_and_blocks_later_epochs(job):
    r = job.rank("0.0")
    assert job.epoch("walltime", final=True)["status"] == "committed"
    # a final epoch is sized (each rank judges Slurm's window before anything freezes) and handed over
    assert r.commands() == ["size", "prepare", "capture", "finish"] and job.committer.final is True
    later = job.epoch("interval")
    assert later["status"] == "skipped" and len(job.committer.calls) == 1


def test_final_triggers_right_after_an_aborted_final_are_skipped(job):
    """Slurm's kill sequence signals every task more than once: one final attempt, not one per signal
    (each would freeze the job again and eat into KillWait)."""
    r = job.rank("0.0", fail="prepare")
    assert job.epoch("sigterm", final=True)["status"] == "aborted"
    again = job.epoch("sigterm", final=True)
    assert again["status"] == "skipped" and "just attempted" in again["why"]
    assert r.commands().count("prepare") == 1
    assert job.epoch("interval")["status"] == "aborted"        # periodic epochs are not affected


@pytest.mark.parametrize("how", ["prepare", "membership"])
def test_a_failed_final_capture_at_slurms_sigterm_tells_every_rank_to_pass_it_on(job, how):
    """Only the coordinator's host sees an epoch's result: the other ranks are told, so that none holds
    Slurm's SIGTERM until KillWait's SIGKILL (task/wrapper.py), whether the capture failed in a phase or was
    refused with nothing frozen (a rank of a step missing). Not for a final capture slurmckpt started itself
    (walltime, manual-requeue: the job runs on) nor a periodic one."""
    ok = job.rank("0.0")
    bad = job.rank("0.1", fail="prepare" if how == "prepare" else None)
    if how == "membership":
        c = RankClient("127.0.0.1", job.port, job.token, "5.0", "n", 0, lambda k, e, m=None: {}, tasks=2)
        threading.Thread(target=c.serve_forever, daemon=True).start()
        wait_for(lambda: "5.0" in job.coord.ranks)
    for reason, final in (("interval", False), ("walltime", True)):
        assert job.epoch(reason, final)["status"] == "aborted"
    assert "pass-sigterm" not in ok.commands() + bad.commands()
    job.coord._final_tried = -1e9                    # past the quiet time after the walltime attempt
    res = job.epoch("sigterm", final=True)
    assert res["status"] == "aborted" and res["stage"] == how
    for r in (ok, bad):
        assert ("pass-sigterm", res["epoch"]) in r.got
    if how == "membership":
        c.close()


def test_epoch_without_ranks_aborts(job):
    res = job.epoch()
    assert res["status"] == "aborted" and not job.committer.calls


@pytest.mark.parametrize("phase", ["prepare", "capture"])
def test_rank_failure_aborts_everyone_and_skips_commit(job, phase):
    ok = [job.rank(f"0.{i}") for i in (0, 2)]
    bad = job.rank("0.1", fail=phase)
    res = job.epoch()
    assert res["status"] == "aborted", res
    assert res["rank"] == "0.1" and res["stage"] == phase and f"{phase} broke" in res["error"]
    assert job.committer.calls == []
    for r in ok + [bad]:
        wait_for(lambda r=r: ("abort", 1) in r.got)
        assert "resume" not in r.commands() and "finish" not in r.commands()
    if phase == "prepare":
        assert "capture" not in bad.commands()


def test_rank_vanishing_mid_epoch_aborts(job):
    ok = job.rank("0.0")
    job.rank("0.1", vanish="capture")
    res = job.epoch()
    assert res["status"] == "aborted" and res["rank"] == "0.1"
    assert "disconnected" in res["error"]
    assert job.committer.calls == []
    wait_for(lambda: ("abort", 1) in ok.got)
    assert "0.1" not in job.coord.ranks
    # the job goes on without the vanished rank
    assert job.epoch()["status"] == "committed"
    assert set(job.committer.calls[-1][1]) == {"0.0"}


def test_rank_leaving_between_phases_fails_the_next_phase_at_once(job):
    """Not at the next phase's timeout (600 s for capture): the rank is known to be gone."""
    job.rank("0.0", slow="prepare")
    job.rank("0.1", vanish_after="prepare")
    start = time.monotonic()
    res = job.epoch()
    assert res["status"] == "aborted" and res["rank"] == "0.1" and res["stage"] == "capture"
    assert "disconnected" in res["error"] and res["node"] == "node-0.1"
    assert time.monotonic() - start < 5
    assert job.committer.calls == []


def test_committer_failure_aborts(tmp_path):
    """Periodic: the trees were already thawed before COMMIT, so they run on uncommitted, and ABORT after
    the resume makes each rank drop its persisted images of the epoch. Final: the trees are still frozen
    and get ABORT (thawed, not killed)."""
    j = Job(Committer(fail=OSError("disk full")))
    try:
        r = j.rank("0.0")
        res = j.epoch()
        assert res["status"] == "aborted" and res["stage"] == "commit" and "disk full" in res["error"]
        wait_for(lambda: ("abort", 1) in r.got)
        assert r.commands() == ["prepare", "capture", "resume", "abort"]
        res = j.epoch("sigterm", final=True)
        assert res["status"] == "aborted" and res["stage"] == "commit"
        wait_for(lambda: ("abort", 2) in r.got)
        assert "finish" not in r.commands()
    finally:
        j.close()


def test_silent_rank_times_out_and_is_named_with_its_node_and_phase(job):
    """A timeout names every rank that had not answered, its node and the phase; the others are aborted."""
    job.coord.prepare_timeout_s = 0.5
    ok = job.rank("0.0")
    hang = threading.Event()
    slow = job.rank("0.1")
    slow.client.handler = lambda kind, epoch, msg=None: (hang.wait(10) if kind == "prepare" else None) or {}
    fut = asyncio.run_coroutine_threadsafe(job.coord.run_epoch("test", False), job.loop.loop)
    wait_for(lambda: ("abort", 1) in ok.got, timeout=3)   # the others are released while 0.1 still hangs
    assert not fut.done() or fut.result()["status"] == "aborted"
    hang.set()
    res = fut.result(TIMEOUT)
    assert res["status"] == "aborted" and res["stage"] == "prepare", res
    assert res["rank"] == "0.1" and res["node"] == "node-0.1"
    assert "no answer to prepare within 0.5s from rank 0.1 (node node-0.1) (1 of 2 rank(s) answered)" == res["error"]
    assert "resume" not in ok.commands() and "capture" not in ok.commands()
    assert job.committer.calls == []


def test_completed_ranks_carried_into_commit_records(job):
    job.rank("0.0")
    done = job.rank("0.1")
    done.client.event("exited", exit_code=3)
    wait_for(lambda: "0.1" in job.coord.completed)
    done.client.close()
    wait_for(lambda: "0.1" not in job.coord.ranks)
    res = job.epoch()
    assert res["status"] == "committed"
    _, records, _ = job.committer.calls[-1]
    assert records["0.1"] == {"kind": "completed", "exit_code": 3, "node": "node-0.1"}
    assert records["0.0"]["kind"] == "image"
    job.epoch()
    assert job.committer.calls[-1][1]["0.1"]["exit_code"] == 3       # and in every later epoch


def test_started_event_is_acked_and_trigger_reaches_callback(job):
    seen, triggers = [], []

    async def on_started(rank, action):
        seen.append((rank, action))
    job.coord.on_started = on_started
    job.coord.on_trigger = lambda reason, final: triggers.append((reason, final))
    r = job.rank("0.0")
    t0 = time.monotonic()
    r.client.event("started", wait_ack=True, timeout=5, action="restore")
    assert time.monotonic() - t0 < 4
    assert seen == [("0.0", "restore")]
    r.client.event("trigger", reason="preempt", final=True)
    wait_for(lambda: triggers == [("preempt", True)])


# ---- refused connections -----------------------------------------------------------------------------------
class Raw:
    """A hand-driven connection: what a forger or a replayer can send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.file = self.sock.makefile("rb")
        self.nonce = parse_line(self.file.readline())["nonce"]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self) -> bool:
        """True when the coordinator hung up (EOF, possibly after a welcome it never follows up on)."""
        try:
            while True:
                line = self.file.readline()
                if not line:
                    return True
                if json.loads(line.partition(b" ")[2] or line).get("type") != "welcome":
                    return False
        except (ConnectionResetError, socket.timeout):
            return False

    def close(self) -> None:
        self.sock.close()


def still_serves(job) -> None:
    r = job.rank(f"0.{len(job.ranks) + 10}")
    res = job.epoch()
    assert res["status"] == "committed", res
    assert r.name in job.committer.calls[-1][1]


def hello(rank: str = "0.9") -> dict:
    return {"type": "hello", "rank": rank, "node": "n", "interval": 0}


def test_wrong_token_refused(job):
    raw = Raw(job.port)
    raw.send(Sealer(new_token(), raw.nonce).seal(hello()))
    assert raw.closed_by_peer()
    assert "0.9" not in job.coord.ranks
    still_serves(job)


def test_forged_mac_refused(job):
    raw = Raw(job.port)
    mac, _, data = Sealer(job.token, raw.nonce).seal(hello("0.9")).partition(b" ")
    msg = json.loads(data)
    msg["rank"] = "0.8"                                   # altered after sealing
    raw.send(mac + b" " + json.dumps(msg).encode() + b"\n")
    assert raw.closed_by_peer()
    assert not {"0.8", "0.9"} & set(job.coord.ranks)
    raw2 = Raw(job.port)
    body = {**hello(), "v": VERSION, "seq": 1}            # no mac at all
    raw2.send((json.dumps(body) + "\n").encode())
    assert raw2.closed_by_peer()
    still_serves(job)


def test_message_replayed_on_another_connection_refused(job):
    first = Raw(job.port)
    line = Sealer(job.token, first.nonce).seal(hello("0.9"))
    first.close()
    second = Raw(job.port)                                # other nonce: the old mac does not verify
    second.send(line)
    assert second.closed_by_peer()
    assert "0.9" not in job.coord.ranks
    still_serves(job)


def test_message_replayed_on_same_connection_refused(job):
    raw = Raw(job.port)
    sealer = Sealer(job.token, raw.nonce)
    raw.send(sealer.seal(hello("0.9")))
    wait_for(lambda: "0.9" in job.coord.ranks)
    ready = sealer.seal({"type": "exited", "exit_code": 0})
    raw.send(ready)
    wait_for(lambda: "0.9" in job.coord.completed)
    job.coord.completed.clear()
    raw.send(ready)                                       # same seq again
    assert raw.closed_by_peer()
    wait_for(lambda: "0.9" not in job.coord.ranks)
    assert "0.9" not in job.coord.completed
    still_serves(job)


def test_wrong_version_refused(job):
    raw = Raw(job.port)
    s = Sealer(job.token, raw.nonce)
    data = json.dumps({**hello(), "v": VERSION + 1, "seq": 1}).encode()
    raw.send(s._mac(data) + b" " + data + b"\n")          # authentic, but v2
    assert raw.closed_by_peer()
    assert "0.9" not in job.coord.ranks
    still_serves(job)


@pytest.mark.parametrize("newline", [True, False])
def test_oversized_line_refused(job, newline):
    raw = Raw(job.port)
    raw.send(b"{" + b"x" * (MAX_LINE + 1000) + (b"\n" if newline else b""))
    assert raw.closed_by_peer()
    still_serves(job)


def test_oversized_line_after_hello_drops_rank(job):
    raw = Raw(job.port)
    raw.send(Sealer(job.token, raw.nonce).seal(hello("0.9")))
    wait_for(lambda: "0.9" in job.coord.ranks)
    raw.send(b"{" + b"x" * (MAX_LINE + 10) + b"\n")
    assert raw.closed_by_peer()
    wait_for(lambda: "0.9" not in job.coord.ranks)
    still_serves(job)


def test_garbage_and_unexpected_type_refused(job):
    raw = Raw(job.port)
    raw.send(b"hello there\n")
    assert raw.closed_by_peer()
    raw2 = Raw(job.port)
    s = Sealer(job.token, raw2.nonce)
    raw2.send(s.seal(hello("0.9")))
    wait_for(lambda: "0.9" in job.coord.ranks)
    raw2.send(s.seal({"type": "prepare", "epoch": 1}))     # a command, from a rank
    assert raw2.closed_by_peer()
    still_serves(job)


def test_client_refuses_wrong_token_coordinator(job):
    """The rank side checks the coordinator too: a client with another token never gets a welcome."""
    with pytest.raises(Exception):
        RankClient("127.0.0.1", job.port, new_token(), "0.5", "n", 0, lambda k, e, m=None: {})
    assert "0.5" not in job.coord.ranks


def test_epoch_refused_while_a_rank_of_a_step_is_missing(job):
    """Never a partial set: a 2-task step with one rank connected is not captured (nothing is frozen)."""
    r0 = FakeRank(job, "3.0")
    r0.client.close()
    job.ranks.append(r0)
    c = RankClient("127.0.0.1", job.port, job.token, "4.0", "n", 0, lambda k, e, m=None: {}, tasks=2)
    threading.Thread(target=c.serve_forever, daemon=True).start()
    wait_for(lambda: "4.0" in job.coord.ranks)
    res = job.epoch()
    assert res["status"] == "aborted" and res["stage"] == "membership" and "4.1" in res["error"]
    c.close()


def test_gpu_lock_rounds_retry_until_every_rank_locks_in_one_round(job):
    """A rank whose lock times out (peer's collective half done: LockContended, sent as error_kind retryable)
    aborts the round: everyone is unlocked (ABORT), and the next round is tried after a backoff; the cut is
    taken in the round where all locked."""
    job.coord.lock_backoff_s = 0.01
    fails = {"n": 2}

    class Flaky(FakeRank):
        def handle(self, kind, epoch, message=None):
            if kind == "prepare" and fails["n"] > 0:
                fails["n"] -= 1
                self.got.append((kind, epoch))
                raise LockContended("GPU lock of pid 7 timed out after 500 ms (CUDA_ERROR_NOT_READY)")
            return super().handle(kind, epoch, message)

    ok = job.rank("0.0")
    flaky = Flaky(job, "0.1")
    job.ranks.append(flaky)
    job.coord.expected["0"] = 2
    res = job.epoch()
    assert res["status"] == "committed" and res["lock_rounds"] == 3, res
    assert ok.commands().count("abort") == 2 and ok.commands().count("prepare") == 3
    job.coord.lock_rounds, fails["n"] = 2, 5
    res = job.epoch()
    assert res["status"] == "aborted" and res["lock_rounds"] == 2


@pytest.mark.parametrize("error", [
    RuntimeError("gpu lock of pid 7 failed: CUDA_ERROR_NOT_READY"),        # a bug's text that says "lock"
    GpuUnsupportedError(["pid 7 uses CUDA IPC: nothing was locked"]),
    SlurmckptError("lock file /var/lock/x is held by another job"),
])
def test_a_failed_prepare_whose_text_says_lock_is_not_retried(job, error):
    """Only a typed retryable error (LockContended) starts another lock round: an error of any other type is
    one round, one PREPARE, one ABORT, whatever its text says."""
    job.coord.lock_backoff_s = 0.01

    class Refusing(FakeRank):
        def handle(self, kind, epoch, message=None):
            if kind == "prepare":
                self.got.append((kind, epoch))
                raise error
            return super().handle(kind, epoch, message)

    ok = job.rank("0.0")
    job.ranks.append(Refusing(job, "0.1"))
    job.coord.expected["0"] = 2
    res = job.epoch()
    assert res["status"] == "aborted" and res["lock_rounds"] == 1 and res["error_kind"] == "fatal", res
    assert "lock" in res["error"]
    assert ok.commands() == ["prepare", "abort"]


def epoch_with_a_rank_failing(job, phase_name: str, error: Exception) -> dict:
    """One epoch of a job whose only rank, 0.0, raises `error` when told `phase_name`."""
    class Failing(FakeRank):
        def handle(self, kind, epoch, message=None):
            if kind == phase_name:
                self.got.append((kind, epoch))
                raise error
            return super().handle(kind, epoch, message)

    job.ranks.append(Failing(job, "0.0"))
    wait_for(lambda: "0.0" in job.coord.ranks)
    return job.epoch()


def test_retryable_kind_counts_only_for_prepare_and_must_be_known(job):
    """error_kind is checked like every field of a reply: a value outside protocol.ERROR_KINDS is refused
    (the rank is dropped), and "retryable" on a phase other than PREPARE is no reason to retry."""
    job.coord.lock_backoff_s = 0.01
    res = epoch_with_a_rank_failing(job, "capture", LockContended("not a lock phase"))
    assert res["status"] == "aborted" and res["lock_rounds"] == 1 and res["error_kind"] == "fatal", res
    assert job.ranks[0].commands().count("prepare") == 1
    with pytest.raises(ProtocolError, match="error_kind"):
        phase.check_reply({"type": "failed", "epoch": 1, "phase": "prepare", "error": "x", "error_kind": "maybe"})
    assert phase.check_reply({"type": "failed", "epoch": 1, "phase": "prepare", "error": "x"})   # older ranks


def test_a_rank_whose_task_just_ended_aborts_the_epoch_as_ended(job):
    """A rank whose tree ended as the capture began (TaskEnded) aborts the epoch with error_kind "ended", on
    whichever phase it fails: the ranks keep such a periodic abort to themselves, and no round is retried."""
    from slurmckpt.errors import TaskEnded
    res = epoch_with_a_rank_failing(job, "prepare", TaskEnded("no running task tree to capture"))
    assert res["status"] == "aborted" and res["error_kind"] == "ended" and res["lock_rounds"] == 1, res
    assert job.ranks[0].commands().count("prepare") == 1
    assert phase.check_reply({"type": "failed", "epoch": 1, "phase": "size", "error": "x", "error_kind": "ended"})


# ---- framing and sealing (protocol.LineReader / Sealer) ---------------------------------------------------
def reference_line(token: str, nonce: str, message: dict, seq: int) -> bytes:
    """The wire format as first specified: json.dumps + hmac.new. Sealer must stay byte-compatible with it."""
    import hashlib
    import hmac
    data = json.dumps({**message, "v": VERSION, "seq": seq}, separators=(",", ":")).encode()
    return hmac.new(bytes.fromhex(token), nonce.encode() + data, hashlib.sha256).hexdigest().encode() + b" " + \
        data + b"\n"


def test_sealer_output_is_the_reference_wire_format():
    token = new_token()
    s = Sealer(token, "n0nce")
    msgs = [{"type": "hello", "rank": "0.1", "node": "n", "interval": 0, "tasks": 2, "last_epoch": 0},
            {"type": "prepare", "epoch": 7}, {"type": "capture", "epoch": 7, "final": True},
            {"type": "failed", "epoch": 7, "phase": "capture", "error": "d\u00e9j\u00e0 \"vu\"\n"}]
    for seq, m in enumerate(msgs, 1):
        assert s.seal(m) == reference_line(token, "n0nce", m, seq)
    assert s.seal_prefix(encode_prefix({"type": "resume", "epoch": 7})) == \
        reference_line(token, "n0nce", {"type": "resume", "epoch": 7}, len(msgs) + 1)
    peer = Sealer(token, "n0nce")                   # and reads reference lines
    assert [peer.open(reference_line(token, "n0nce", m, seq)) for seq, m in enumerate(msgs, 1)] == \
        [{**m, "v": VERSION, "seq": seq} for seq, m in enumerate(msgs, 1)]


def test_sealer_rejects_bad_mac_replay_reorder_and_other_nonce():
    token = new_token()
    out, peer = Sealer(token, "a"), Sealer(token, "a")
    first, second = out.seal({"type": "ready", "epoch": 1}), out.seal({"type": "ready", "epoch": 2})
    with pytest.raises(ProtocolError, match="out of sequence"):
        Sealer(token, "a").open(second)                                 # reordered
    with pytest.raises(ProtocolError, match="authentication"):
        Sealer(token, "b").open(first)                                  # other connection's nonce
    with pytest.raises(ProtocolError, match="authentication"):
        Sealer(new_token(), "a").open(first)                            # other job's token
    flipped = first.replace(b'"epoch":1', b'"epoch":9')
    with pytest.raises(ProtocolError, match="authentication"):
        peer.open(flipped)                                              # altered after sealing
    with pytest.raises(ProtocolError, match="authentication"):
        peer.open(first[1:])                                            # truncated mac
    assert peer.open(first)["epoch"] == 1
    with pytest.raises(ProtocolError, match="out of sequence"):
        peer.open(first)                                                # replayed
    assert peer.open(second)["epoch"] == 2


@pytest.mark.parametrize("data, why", [
    (b"{not json}", "malformed"), (b'{"v":2,"type":"x"} trailing', "malformed"), (b'{"v":2,"type":"x"}{}', "malformed"),
    (b"\xff\xfe", "malformed"), (b"[1,2]", "not an object"), (b'{"v":1,"type":"x"}', "version"),
    (b'{"v":2}', "no type"), (b"", "malformed")])
def test_parse_line_rejects(data, why):
    with pytest.raises(ProtocolError, match=why):
        parse_line(data)


def test_parse_line_accepts_surrounding_whitespace_like_json_loads():
    assert parse_line(b' {"v":2,"type":"x"}\n') == {"v": 2, "type": "x"}


def test_sealer_rejects_authentic_but_malformed_json():
    token = new_token()
    out, peer = Sealer(token, "a"), Sealer(token, "a")
    data = b'{"type":"ready","v":2,"seq":1'                            # cut short, then sealed
    with pytest.raises(ProtocolError, match="malformed"):
        peer.open(out._mac(data) + b" " + data + b"\n")


def test_line_reader_joins_a_line_split_across_reads():
    r = LineReader()
    assert r.feed(b'{"a"') == [] and r.feed(memoryview(b":1")) == [] and r.feed(b"}\n") == [b'{"a":1}']
    assert r.tail == b""


def test_line_reader_splits_several_lines_in_one_read_and_keeps_the_rest():
    r = LineReader()
    assert r.feed(b"one\ntwo\nthr") == [b"one", b"two"]
    assert r.feed(b"ee\n\nfour\n") == [b"three", b"", b"four"]


def test_line_reader_bounds_lines():
    r = LineReader(limit=8)
    assert r.feed(b"1234567\n") == [b"1234567"]                        # 7 bytes + newline: fits
    with pytest.raises(ProtocolError, match="too long"):
        LineReader(limit=8).feed(b"12345678\n")
    with pytest.raises(ProtocolError, match="too long"):
        LineReader(limit=8).feed(b"ok\n12345678")                       # unterminated: refused before its end
    r = LineReader(limit=8)
    assert r.feed(b"1234") == []
    with pytest.raises(ProtocolError, match="too long"):
        r.feed(b"5678")                                                 # grows past the bound across reads
    assert LineReader().limit == MAX_LINE


# ---- connection handling ------------------------------------------------------------------------------------
def test_hello_split_across_writes_and_messages_batched_in_one_write(job):
    raw = Raw(job.port)
    s = Sealer(job.token, raw.nonce)
    line = s.seal(hello("0.7"))
    for i in range(0, len(line), 7):                                   # the hello dribbles in
        raw.send(line[i:i + 7])
        time.sleep(0.001)
    wait_for(lambda: "0.7" in job.coord.ranks)
    raw.send(s.seal({"type": "trigger", "reason": "a"}) + s.seal({"type": "exited", "exit_code": 4}))
    wait_for(lambda: "0.7" in job.coord.completed)
    assert job.coord.completed["0.7"]["exit_code"] == 4
    assert "0.7" in job.coord.ranks


def test_last_line_without_newline_before_eof_still_counts(job):
    raw = Raw(job.port)
    s = Sealer(job.token, raw.nonce)
    raw.send(s.seal(hello("0.7")))
    wait_for(lambda: "0.7" in job.coord.ranks)
    raw.send(s.seal({"type": "exited", "exit_code": 5})[:-1])
    raw.sock.shutdown(socket.SHUT_WR)
    wait_for(lambda: "0.7" not in job.coord.ranks)
    assert job.coord.completed["0.7"]["exit_code"] == 5


def test_bad_mac_after_hello_drops_rank(job):
    raw = Raw(job.port)
    s = Sealer(job.token, raw.nonce)
    raw.send(s.seal(hello("0.7")))
    wait_for(lambda: "0.7" in job.coord.ranks)
    line = s.seal({"type": "exited", "exit_code": 0})
    raw.send(b"0" * 64 + line[64:])
    assert raw.closed_by_peer()
    wait_for(lambda: "0.7" not in job.coord.ranks)
    assert "0.7" not in job.coord.completed
    still_serves(job)


def test_oversized_line_dribbled_in_is_refused_before_its_end(job):
    raw = Raw(job.port)
    raw.send(Sealer(job.token, raw.nonce).seal(hello("0.7")))
    wait_for(lambda: "0.7" in job.coord.ranks)
    chunk = b"x" * 4096
    for _ in range(MAX_LINE // len(chunk) + 1):                         # never a newline
        raw.send(chunk)
    wait_for(lambda: "0.7" not in job.coord.ranks)
    assert raw.closed_by_peer()
    still_serves(job)


def test_silent_connection_is_dropped_after_hello_timeout(job, monkeypatch):
    monkeypatch.setattr(connection, "HELLO_TIMEOUT_S", 0.2)
    raw = Raw(job.port)
    t0 = time.monotonic()
    assert raw.closed_by_peer()
    assert time.monotonic() - t0 < 5
    still_serves(job)


def test_messages_after_started_wait_for_its_callback(job):
    """`started` awaits on_started before its ack; what the rank sent after it is handled after that, in order."""
    release, order = asyncio.Event(), []

    async def on_started(rank, action):
        order.append("started")
        await release.wait()
        order.append("released")
    job.coord.on_started = on_started
    raw = Raw(job.port)
    s = Sealer(job.token, raw.nonce)
    raw.send(s.seal(hello("0.7")))
    wait_for(lambda: "0.7" in job.coord.ranks)
    raw.send(s.seal({"type": "started", "action": "run"}) + s.seal({"type": "exited", "exit_code": 2}))
    wait_for(lambda: order == ["started"])
    time.sleep(0.1)
    assert "0.7" not in job.coord.completed                            # held behind the callback
    job.loop.loop.call_soon_threadsafe(release.set)
    wait_for(lambda: "0.7" in job.coord.completed)
    ack = Sealer(job.token, raw.nonce)
    ack.open(raw.file.readline())                                       # welcome
    assert ack.open(raw.file.readline()) == {"type": "ack", "ref": 2, "v": VERSION, "seq": 2}


def test_two_failing_ranks_and_an_empty_phase(job):
    """The first failure decides the phase; a second one is no unhandled error. No rank: nothing to wait for."""
    job.rank("0.0", fail="prepare")
    job.rank("0.1", fail="prepare")
    res = job.epoch()
    assert res["status"] == "aborted" and res["stage"] == "prepare" and res["rank"] in ("0.0", "0.1")
    assert job.loop.run(job.coord._phase([], "abort", "done", 99, 1)) == []


def test_stop_closes_every_connection(job):
    r = job.rank("0.0")
    raw = Raw(job.port)                                                 # not even past its hello
    job.loop.run(job.coord.stop())
    assert raw.closed_by_peer()
    r.thread.join(5)
    assert r.client.closed.is_set()
