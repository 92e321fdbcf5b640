"""Framed JSON + SCM_RIGHTS between wrapper and agent: fds arrive usable, bad frames are ProtocolErrors."""
from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from slurmckpt.channel import MAX_FRAME, Channel
from slurmckpt.errors import LockContended, PermissionDenied, ProtocolError, SlurmckptError


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Channel(a), Channel(b)
    yield ca, cb
    ca.close()
    cb.close()


def refs_to(fd: int) -> int:
    """How many of our fds point at the same pipe as `fd` (robust against other threads' fds)."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    n = 0
    for x in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{x}") == target
        except OSError:
            pass
    return n


def test_message_roundtrip(pair):
    a, b = pair
    a.send({"op": "hello", "n": [1, 2, 3], "s": "ü"})
    msg, fds = b.recv()
    assert msg == {"op": "hello", "n": [1, 2, 3], "s": "ü"} and fds == []


def test_fds_pass_and_stay_usable(pair):
    a, b = pair
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    a.send({"op": "launch"}, [w1, w2, w1])
    msg, fds = b.recv()
    try:
        assert msg == {"op": "launch"} and len(fds) == 3
        assert not set(fds) & {r1, w1, r2, w2}                  # fresh descriptors in the receiver
        os.write(fds[0], b"one")
        os.write(fds[1], b"two")
        assert os.read(r1, 10) == b"one" and os.read(r2, 10) == b"two"
        assert os.fstat(fds[2]).st_ino == os.fstat(w1).st_ino
    finally:
        for fd in (r1, w1, r2, w2, *fds):
            os.close(fd)


def test_consecutive_messages_keep_framing(pair):
    a, b = pair
    r, w = os.pipe()
    a.send({"i": 1})
    a.send({"i": 2}, [w])
    a.send({"i": 3})
    got = [b.recv() for _ in range(3)]
    assert [m["i"] for m, _ in got] == [1, 2, 3]
    assert [len(f) for _, f in got] == [0, 1, 0]
    for fd in (r, w, *got[1][1]):
        os.close(fd)


def test_large_message_below_limit(pair):
    a, b = pair
    blob = "x" * (MAX_FRAME - 100)
    t = threading.Thread(target=a.send, args=({"b": blob},))
    t.start()
    msg, _ = b.recv()
    t.join()
    assert len(msg["b"]) == len(blob)


def test_sender_refuses_oversized_message(pair):
    a, _ = pair
    with pytest.raises(ProtocolError, match="too large"):
        a.send({"b": "x" * MAX_FRAME})


def test_oversized_frame_header_is_protocol_error(pair):
    a, b = pair
    a.sock.sendall(struct.pack("!I", MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="oversized"):
        b.recv()
    a.sock.sendall(struct.pack("!I", 0xFFFFFFFF))
    with pytest.raises(ProtocolError, match="oversized"):
        b.recv()


@pytest.mark.parametrize("body,match", [(b"{not json", "malformed"), (b"\xff\xfe", "malformed"),
                                        (b"[1, 2]", "not an object"), (b'"str"', "not an object"),
                                        (b"", "malformed")])
def test_malformed_frame_is_protocol_error_and_stream_stays_in_sync(pair, body, match):
    a, b = pair
    a.sock.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(ProtocolError, match=match):
        b.recv()
    a.send({"op": "next"})                                  # the receiver can go on reading
    assert b.recv()[0] == {"op": "next"}


def test_eof_between_and_inside_frames(pair):
    a, b = pair
    a.sock.sendall(struct.pack("!I", 10) + b"{")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        b.recv()
    with pytest.raises(EOFError):
        b.recv()


def test_call_maps_error_reply_to_named_exception(pair):
    a, b = pair

    def server():
        for err in ("PermissionDenied", "NoSuchError", "annotations", "SystemExit"):
            b.recv()
            b.send({"ok": False, "error": "nope", "error_type": err})
        m, _ = b.recv()
        b.send({"ok": True, "echo": m["x"]})
    t = threading.Thread(target=server)
    t.start()
    with pytest.raises(PermissionDenied, match="nope"):
        a.call("launch")
    for _ in range(3):                                     # unknown or non-error names: the base class only
        with pytest.raises(SlurmckptError) as e:
            a.call("launch")
        assert type(e.value) is SlurmckptError
    assert a.call("echo", x=5)["echo"] == 5
    t.join()


def test_a_retryable_lock_error_keeps_its_type_across_the_channel(pair):
    """The agent replies with the error's type name; the wrapper raises that type again, so LockContended
    (the one error a lock round retries) reaches the coordinator client as a type, not as text."""
    a, b = pair

    def agent():
        b.recv()
        e = LockContended("GPU lock of pid 7 timed out after 500 ms (CUDA_ERROR_NOT_READY)", pid=7)
        b.send({"ok": False, "error": str(e), "error_type": type(e).__name__})
    t = threading.Thread(target=agent)
    t.start()
    with pytest.raises(LockContended) as e:
        a.call("prepare", epoch=3)
    t.join()
    assert e.value.retryable and "pid=7" in str(e.value) and e.value.context["op"] == "prepare"


@pytest.mark.parametrize("stage, expect", [("gpu-checkpoint", "gpu-checkpoint"), ("", None), (7, None)])
def test_the_failed_rank_stage_crosses_the_channel_as_context(pair, stage, expect):
    """The coordinator's abort message names the stage a rank failed in: the agent's reply carries it, and
    only a non-empty string counts."""
    a, b = pair

    def agent():
        b.recv()
        b.send({"ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY", "error_type": "GpuError", "stage": stage})
    t = threading.Thread(target=agent)
    t.start()
    with pytest.raises(SlurmckptError) as e:
        a.call("prepare", epoch=3)
    t.join()
    assert e.value.context.get("stage") == expect and type(e.value).__name__ == "GpuError"


def test_call_closes_fds_a_reply_carries(pair):
    a, b = pair
    r, w = os.pipe()

    def server():
        b.recv()
        b.send({"ok": True}, [w])
    t = threading.Thread(target=server)
    t.start()
    a.call("x")
    t.join()
    assert refs_to(w) == 2                                # r and w only: the received copy was closed
    os.close(r)
    os.close(w)


def test_rejected_frame_does_not_leak_passed_fds(pair):
    a, b = pair
    r, w = os.pipe()
    body = b"[1]"
    frame = struct.pack("!I", len(body)) + body
    import array
    a.sock.sendmsg([frame[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]))])
    a.sock.sendall(frame[1:])
    with pytest.raises(ProtocolError):
        b.recv()
    assert refs_to(w) == 2
