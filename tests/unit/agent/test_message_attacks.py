"""Hostile messages: NaN/Infinity, oversized, malformed and forged values sent to the agent's operations, the
wrapper<->agent channel, the coordinator (before and after authentication) and a rank's client. Each test
asserts the effect that must not happen (a hang, a crash, a commit, a path outside the store)."""
from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmckpt.agent.service import Agent
from slurmckpt.identity import TaskIdentity
from slurmckpt.channel import Channel
from slurmckpt.coordinator import connection
from slurmckpt.coordinator.client import RankClient
from slurmckpt.coordinator.protocol import VERSION, Sealer, new_token
from slurmckpt.errors import PermissionDenied, ProtocolError, SlurmckptError
from slurmckpt.store.fresh_start import FailureReporter
from slurmckpt.policy import JobPolicy
from slurmckpt.store.jobstore import JobStore
from fake_runner import fake_runner

from test_coordinator import Committer, Job, Raw, still_serves, wait_for  # noqa: E402  (tests/unit helpers)

TOKEN = "ab" * 32


# ---- the agent's operations (called directly: what a forged wrapper request reaches) -----------------------
@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    from test_agent_logic import assemble
    store = JobStore(tmp_path / "images", "c", 77)
    store.ensure()
    # job-instance binding (no instance, no store note): not what these tests are about
    return assemble(TaskIdentity("c", 77, "batch", 0, 1000, 1000, 1), store, config=SimpleNamespace(keep_epochs=2),
                    runner=fake_runner(capture=lambda epoch, final: {"final": final}, prepare=lambda epoch: {},
                                           resume=lambda epoch: {}, abort=lambda epoch: None, killed_for=""),
                    reporter=FailureReporter(store, 77, "batch.0", "node1", annotate=lambda job, text: "AdminComment",
                                             background=False))


def _bounded(fn, seconds: float = 3.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds}s: the agent would hang"
    return out[0]


@pytest.mark.parametrize("wait", [float("nan"), float("inf"), float("-inf"), 1e300, -5, "NaN", [1], True])
def test_lookup_coordinator_refuses_non_finite_and_huge_wait(agent, wait):
    kind, result = _bounded(lambda: agent.job.lookup_coordinator({"scope": "job", "wait_s": wait}, []))
    assert kind == "raised" and isinstance(result, ProtocolError) and "wait_s" in str(result)


def test_lookup_coordinator_still_waits_a_bounded_time(agent):
    t0 = time.monotonic()
    assert agent.job.lookup_coordinator({"scope": "job", "wait_s": 0.3}, []) == {"found": False}
    assert 0.25 < time.monotonic() - t0 < 2


@pytest.mark.parametrize("field,value", [("host", "0.0.0.0"), ("host", "evil.example"), ("host", 7),
                                         ("port", float("nan")), ("port", 70000), ("port", 0), ("port", "22"),
                                         ("token", "x" * 64), ("token", None), ("scope", "../../other"),
                                         ("scope", "batch")])
def test_publish_coordinator_refuses_bad_values(agent, field, value):
    m = {"scope": "job", "host": "127.0.0.1", "port": 4000, "token": TOKEN, field: value}
    with pytest.raises(ProtocolError, match=field):
        agent.job.publish_coordinator(m, [])
    assert not list(agent.facts.store.job_dir.glob("coordinator-*")), "a file was written anyway"


def test_publish_then_lookup_roundtrip(agent):
    agent.job.publish_coordinator({"scope": "job", "host": "127.0.0.1", "port": 4000, "token": TOKEN}, [])
    found = agent.job.lookup_coordinator({"scope": "job", "wait_s": 0}, [])
    assert found["found"] and found["port"] == 4000 and found["token"] == TOKEN


@pytest.mark.parametrize("ranks,field", [
    ({"../../../etc/x.0": {"kind": "image"}}, "ranks name"),
    ({"batch.0/../../x": {"kind": "image"}}, "ranks name"),
    ({"batch.-1": {"kind": "image"}}, "ranks name"),
    ({"batch.0": {"kind": "completed", "exit_code": float("nan")}}, "exit_code"),
    ({"batch.0": {"kind": "image", "epoch": 1}}, "unknown keys"),
    ({}, "ranks"),
    ("batch.0", "ranks"),
])
def test_commit_refuses_bad_rank_names_and_records(agent, ranks, field):
    with pytest.raises(ProtocolError, match=field):
        agent.job.commit({"epoch": 1, "ranks": ranks, "reason": "interval"}, [])
    assert agent.facts.store.committed() == [], "something was committed"


@pytest.mark.parametrize("reason", ["\x1b[2Jpwned", "a" * 65, 7, None, ""])
def test_commit_refuses_a_reason_that_is_not_a_short_label(agent, reason):
    with pytest.raises(ProtocolError, match="reason"):
        agent.job.commit({"epoch": 1, "ranks": {"batch.0": {"kind": "completed", "exit_code": 0}},
                         "reason": reason}, [])


def test_a_valid_commit_passes_validation(agent):
    """Validation lets it through (whatever the store then decides: the instance binding is not ours)."""
    try:
        agent.job.commit({"epoch": 1, "ranks": {"batch.0": {"kind": "completed", "exit_code": 0, "node": "n1"}},
                         "reason": "interval"}, [])
    except ProtocolError:
        raise
    except SlurmckptError:
        pass


@pytest.mark.parametrize("epoch", [float("nan"), float("inf"), 0, -1, 10**6, "1", True, None, 1.0])
def test_epoch_taking_operations_refuse_bad_epochs(agent, epoch):
    for op in (agent.epochs.prepare, agent.epochs.capture, agent.epochs.resume, agent.job.reject_epoch):
        with pytest.raises(ProtocolError, match="epoch"):
            op({"epoch": epoch}, [])


def test_capture_final_must_be_a_bool_and_reject_reason_bounded_text(agent):
    with pytest.raises(ProtocolError, match="final"):
        agent.epochs.capture({"epoch": 1, "final": "no"}, [])
    agent.epochs.prepare({"epoch": 1, "final": False, "trigger": "interval"}, [])
    assert agent.epochs.capture({"epoch": 1, "final": False}, []) == {"final": False}
    for reason in (["x"], 5, "x" * 70_000):
        with pytest.raises(ProtocolError, match="reason"):
            agent.job.reject_epoch({"epoch": 1, "reason": reason}, [])


def test_final_is_fixed_at_prepare_so_min_interval_cannot_be_dodged(agent):
    """The policy judges PREPARE's `final` (a final capture is never refused for its timing); a CAPTURE that
    then says final=False would be a periodic capture (the tree runs on) below min_interval. CAPTURE takes
    PREPARE's flag: a differing one is refused, a missing one is PREPARE's, and a CAPTURE without its
    PREPARE is refused."""
    agent.facts.policy = JobPolicy(min_interval=3600, min_from="partition low")
    agent.epochs.prepare({"epoch": 1, "final": False, "trigger": "interval"}, [])
    assert agent.epochs.capture({"epoch": 1, "final": False}, []) == {"final": False}
    with pytest.raises(PermissionDenied, match="minimum interval"):
        agent.epochs.prepare({"epoch": 2, "final": False, "trigger": "interval"}, [])
    agent.epochs.prepare({"epoch": 2, "final": True, "trigger": "sigterm"}, [])        # exempt: a final one
    with pytest.raises(ProtocolError, match="its PREPARE said final=True"):
        agent.epochs.capture({"epoch": 2, "final": False}, [])                          # the attack
    assert agent.epochs.capture({"epoch": 2}, []) == {"final": True}                     # the tree ends after it
    with pytest.raises(ProtocolError, match="without its PREPARE"):
        agent.epochs.capture({"epoch": 3, "final": True}, [])


def test_an_aborted_periodic_capture_counts_for_min_interval(agent):
    """min_interval counts from a periodic capture's PREPARE whether the epoch resumed or was aborted after
    its images were dumped: PREPARE, CAPTURE, ABORT in a loop captured as often as the job liked."""
    agent.facts.policy = JobPolicy(min_interval=3600, min_from="partition low")
    agent.epochs.prepare({"epoch": 1, "final": False, "trigger": "interval"}, [])
    agent.epochs.capture({"epoch": 1, "final": False}, [])
    agent.epochs.abort({"epoch": 1}, [])
    with pytest.raises(PermissionDenied, match="minimum interval"):
        agent.epochs.prepare({"epoch": 2, "final": False, "trigger": "manual"}, [])


def test_storage_paths_refuse_what_validation_refuses(agent):
    for step, rank in (("../x", 0), ("batch", -1), ("batch/..", 0), ("1", 10**9)):
        with pytest.raises(ProtocolError):
            agent.facts.store.rank_dir(1, step, rank)
    with pytest.raises(ProtocolError, match="epoch"):
        agent.facts.store.epoch_dir(-3)


# ---- the operation table: the agent's single dispatch -------------------------------------------------------------
# Every name the wrapper may send, and no other: a change here is a change of what the job's user can ask of root.
OPERATIONS = {"hello", "plan", "standins", "fresh_start", "launch", "restore", "pmi_socket", "srun_standin",
              "tree_fate", "size", "prepare", "capture", "resume", "abort", "finish", "interruptions",
              "interval_chosen", "capture_failed", "commit", "allocate_epoch", "reject_epoch", "publish_coordinator",
              "lookup_coordinator"}


def test_the_operation_table_is_the_agents_single_dispatch(tmp_path: Path) -> None:
    """The table names exactly the accepted operations, each a handler of one of the agent's parts; no method
    is reachable by name: nothing else is routed (no `op_` prefix looked up on any object)."""
    from test_agent_logic import make_agent
    a = make_agent(tmp_path)
    assert set(a.operations) == OPERATIONS
    assert all(callable(handler) for handler in a.operations.values())
    assert {name: a.operation(name) for name in OPERATIONS} == a.operations
    for part in (a, a.plan, a.tree, a.epochs, a.job):
        assert not [n for n in dir(part) if n.startswith("op_")], part


@pytest.mark.parametrize("op", ["become_root", "op_hello", "serve", "shutdown", "operation", "_reply_error",
                                "__init__", "__class__", "start", "follow_size", "not_restorable", "HELLO", "hello ",
                                "", None, 5, True, ["hello"], {"op": "hello"}])
def test_an_unknown_operation_is_refused_as_before_and_serving_goes_on(tmp_path: Path, op) -> None:
    """A name outside the table, a method's name or a value that is no string at all: refused with the same
    reply, nothing run, and the next request is served."""
    from test_agent_logic import FakeChannel, make_agent
    chan = FakeChannel(({"op": op, "epoch": 1}, []), ({"op": "hello"}, []))
    a = make_agent(tmp_path, chan)
    a.serve()
    assert chan.sent[0] == {"ok": False, "error": f"unknown operation {op!r}", "error_type": "ProtocolError"}
    assert chan.sent[1]["ok"] is True and a.tree.cgroup.done == ["kill_all", "remove"]


# ---- the wrapper <-> agent channel -------------------------------------------------------------------------------
@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield Channel(a), Channel(b)
    a.close()
    b.close()


@pytest.mark.parametrize("body", [b'{"op":"lookup_coordinator","wait_s":NaN}', b'{"wait_s":Infinity}',
                                  b'{"x":-Infinity}', b"[" * 200_000, b'{"n":' + b"9" * 10_000 + b"}"])
def test_channel_refuses_nan_infinity_deep_nesting_and_huge_ints(pair, body):
    a, b = pair
    a.sock.sendall(struct.pack("!I", len(body)) + body)
    a.send({"op": "hello"})
    with pytest.raises(ProtocolError, match="malformed"):
        b.recv()
    assert b.recv()[0] == {"op": "hello"}          # the length prefix kept the stream in sync


def test_channel_sender_refuses_nan(pair):
    a, _ = pair
    with pytest.raises(ProtocolError):
        a.send({"wait_s": float("nan")})


# ---- the coordinator -------------------------------------------------------------------------------------------
@pytest.fixture
def job():
    j = Job(Committer())
    yield j
    j.close()


def sealed_raw(sealer: Sealer, data: bytes) -> bytes:
    """An authentic line (the token is known) whose JSON json.dumps would never write (NaN...)."""
    sealer.sent += 1
    return sealer._mac(data) + b" " + data + b"\n"


@pytest.mark.parametrize("fields", [b'"interval":NaN', b'"interval":1e999', b'"tasks":1000000000',
                                    b'"tasks":-1', b'"last_epoch":Infinity', b'"last_epoch":"9"',
                                    b'"node":"\\u001b[2J"', b'"rank":"../../x.0"', b'"rank":"0.01"',
                                    b'"rank":7'])
def test_hello_with_bad_values_is_refused_and_the_coordinator_serves_on(job, fields):
    raw = Raw(job.port)
    base = {"rank": b'"0.9"', "node": b'"n"', "interval": b"0", "tasks": b"1"}
    key = fields.split(b":")[0].strip(b'"').decode()
    parts = [b'"type":"hello"'] + [b'"%s":%s' % (k.encode(), v) for k, v in base.items() if k != key] + [fields]
    data = b"{" + b",".join(parts) + b',"v":%d,"seq":1}' % VERSION
    raw.send(sealed_raw(Sealer(job.token, raw.nonce), data))
    assert raw.closed_by_peer()
    assert not job.coord.ranks and job.coord.expected.get("0", 1) == 1
    assert job.coord.next_epoch < 10, "a hostile last_epoch moved the epochs"
    still_serves(job)


@pytest.mark.parametrize("reply", [b'"kind":"evil","bytes":0', b'"kind":"image","bytes":NaN',
                                   b'"kind":"image","bytes":-1', b'"kind":"image","bytes":1e400'])
def test_a_bad_capture_reply_aborts_the_epoch_and_commits_nothing(job, reply):
    good = job.rank("0.0")
    raw = Raw(job.port)
    sealer, opener = Sealer(job.token, raw.nonce), Sealer(job.token, raw.nonce)
    raw.send(sealer.seal({"type": "hello", "rank": "0.1", "node": "n", "interval": 0}))
    assert opener.open(raw.file.readline())["type"] == "welcome"

    def rank() -> None:            # a forged rank of the job: answers prepare, then a poisoned capture
        while True:
            line = raw.file.readline()
            if not line:
                return
            msg = opener.open(line)
            if msg["type"] == "size":
                raw.send(sealer.seal({"type": "sized", "epoch": msg["epoch"]}))
            elif msg["type"] == "prepare":
                raw.send(sealer.seal({"type": "ready", "epoch": msg["epoch"]}))
            elif msg["type"] == "capture":
                raw.send(sealed_raw(sealer, b'{"type":"captured","epoch":%d,%s,"v":2,"seq":%d}'
                                    % (msg["epoch"], reply, sealer.sent + 1)))
            elif msg["type"] in ("abort", "resume", "finish"):
                raw.send(sealer.seal({"type": "done", "epoch": msg["epoch"]}))
    threading.Thread(target=rank, daemon=True).start()
    result = job.epoch()
    assert result["status"] == "aborted", result
    assert job.committer.calls == [], "an epoch with a malformed reply was committed"
    assert "abort" in good.commands()
    job.ranks.remove(good)
    good.client.close()
    wait_for(lambda: "0.0" not in job.coord.ranks)
    still_serves(job)


@pytest.mark.parametrize("event", [{"type": "trigger", "reason": "\x1b]0;x\x07", "final": True},
                                   {"type": "trigger", "reason": "x", "final": "yes"},
                                   {"type": "exited", "exit_code": 10**12},
                                   {"type": "withdrawn", "epoch": "../1"},
                                   {"type": "started", "action": "x" * 500}])
def test_bad_events_drop_the_sender_and_change_nothing(job, event):
    triggers: list = []
    job.coord.on_trigger = lambda reason, final: triggers.append((reason, final))
    raw = Raw(job.port)
    sealer = Sealer(job.token, raw.nonce)
    raw.send(sealer.seal({"type": "hello", "rank": "0.5", "node": "n", "interval": 0}))
    raw.send(sealer.seal(event))
    assert raw.closed_by_peer()
    assert triggers == [] and job.coord.withdrawn == "" and "0.5" not in job.coord.completed
    still_serves(job)


@pytest.mark.parametrize("garbage", [b"[" * 60_000 + b"\n", b"x" * 70_000 + b"\n", b"\x00\xff\n",
                                     b'{"type":"hello","v":2,"seq":1,"interval":NaN}\n',
                                     b"%s {\"type\":\"hello\",\"rank\":\"0.0\",\"v\":1,\"seq\":1}\n" % (b"0" * 64)])
def test_unauthenticated_garbage_and_forged_macs_are_refused(job, garbage):
    raw = Raw(job.port)
    raw.send(garbage)
    assert raw.closed_by_peer()
    assert not job.coord.ranks
    still_serves(job)


def test_idle_connections_are_capped_and_timed_out(monkeypatch):
    monkeypatch.setattr(connection, "HELLO_TIMEOUT_S", 1.0)
    j = Job(Committer(), max_pending=8)
    try:
        idle = [Raw(j.port) for _ in range(20)]
        wait_for(lambda: len(j.coord._pending) <= 8)
        assert sum(r.closed_by_peer() for r in idle[:12]) == 12, "the oldest idle connections stayed open"
        still_serves(j)                       # a rank still gets in past the idle crowd...
        t0 = time.monotonic()
        assert all(r.closed_by_peer() for r in idle[12:])        # ...and the rest time out
        assert time.monotonic() - t0 < 5
        wait_for(lambda: not j.coord._pending)
    finally:
        j.close()


# ---- a rank's client against whatever answers on the coordinator's port -----------------------------------------
@pytest.mark.parametrize("first", [b'{"v":2,"type":"challenge"}\n', b'{"v":2,"type":"challenge","nonce":7}\n',
                                   b'{"v":2,"type":"challenge","nonce":"../../"}\n', b"[" * 60_000 + b"\n",
                                   b'{"v":2,"type":"challenge","nonce":NaN}\n', b"\xff\n", b"x" * 70_000, b""])
def test_a_forged_challenge_is_a_protocol_error_for_the_rank_never_a_crash(first):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def squatter() -> None:
        conn, _ = listener.accept()
        conn.sendall(first)
        time.sleep(0.5)
        conn.close()
    threading.Thread(target=squatter, daemon=True).start()
    with pytest.raises((SlurmckptError, EOFError, OSError)):     # what membership._connect catches
        RankClient("127.0.0.1", port, new_token(), "0.0", "n", 0, lambda *a: {})
    listener.close()


def test_a_dribbling_squatter_cannot_hold_a_rank_past_the_handshake_limit(monkeypatch):
    from slurmckpt.coordinator import client
    monkeypatch.setattr(client, "HANDSHAKE_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def squatter() -> None:
        conn, _ = listener.accept()
        while not stop.is_set():
            try:
                conn.sendall(b"[")
            except OSError:
                return
            time.sleep(0.1)
    threading.Thread(target=squatter, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises((SlurmckptError, EOFError, OSError)):
        RankClient("127.0.0.1", listener.getsockname()[1], new_token(), "0.0", "n", 0, lambda *a: {})
    assert time.monotonic() - t0 < 4
    stop.set()
    listener.close()


def test_a_bad_command_from_an_authentic_coordinator_ends_the_session_cleanly(job):
    got: list = []
    client = RankClient("127.0.0.1", job.port, job.token, "0.0", "n", 0,
                        lambda kind, epoch, msg: got.append(kind) or {})
    thread = threading.Thread(target=client.serve_forever, daemon=True)
    thread.start()
    wait_for(lambda: "0.0" in job.coord.ranks)
    rank = job.coord.ranks["0.0"]
    job.loop.loop.call_soon_threadsafe(rank.send, {"type": "prepare", "epoch": "../../x"})
    thread.join(5)
    assert not thread.is_alive() and client.closed.is_set() and got == []
    client.close()
