"""Wire format between ranks and the coordinator: one JSON object per line, versioned, HMAC-SHA256
authenticated with the job's token (known only to the job's own wrappers, handed out by root agents),
bound to a per-connection nonce and a sequence number so messages cannot be replayed or reordered.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

from slurmckpt import validate
from slurmckpt.errors import ProtocolError, TaskEnded, is_retryable

VERSION = 2         # 2: the SIZE phase (size -> sized) before PREPARE
MAX_LINE = 64 * 1024

# Message types. Coordinator -> rank: commands; rank -> coordinator: replies and events.
COMMANDS = {"size", "prepare", "capture", "resume", "finish", "abort", "pass-sigterm", "welcome", "ack"}
# pass-sigterm: the job's final capture at Slurm's SIGTERM failed; each rank that got the signal passes it on
# to its program (as without slurmckpt) instead of holding it until KillWait's SIGKILL
EVENTS = {"hello", "sized", "ready", "captured", "failed", "done", "exited", "trigger", "started", "withdrawn"}
# What starts an epoch (a `trigger` event's reason, carried on to the ranks' agents and their commit's
# reason): the interval (coordinator/host.py), the wall-time (task/schedule.py), Slurm's SIGTERM,
# `slurmckpt checkpoint` and `slurmckpt requeue` (task/wrapper.py); agent/metrics.py counts by it.
TRIGGERS = ("interval", "walltime", "sigterm", "manual", "manual-requeue")

# What a `failed` reply says of its error, as a kind and never as text: "retryable" (errors.LockContended, a
# GPU lock that timed out on work in flight, or errors.ExchangeInFlight, a rank frozen inside a PMI exchange:
# the coordinator tries the lock round again), "ended" (errors.TaskEnded: a rank's tree ended as the capture
# began; ranks say nothing of such a periodic capture) or "fatal".
ERROR_KINDS = ("fatal", "retryable", "ended")


def error_kind(exc: BaseException) -> str:
    return "retryable" if is_retryable(exc) else "ended" if isinstance(exc, TaskEnded) else "fatal"


_BLOCK = 64                     # SHA-256 block size, for the HMAC pads (RFC 2104)
_decode = validate.DECODER.raw_decode   # json.loads minus its sniffing and regex passes; no NaN/Infinity


def new_token() -> str:
    return secrets.token_hex(32)


def encode_prefix(message: dict[str, Any]) -> bytes:
    """The JSON bytes of `message` + version, up to the sequence number: `{...,"v":1,"seq":`. A command sent
    to every rank is encoded once; each connection only appends its own seq (see Sealer.seal_prefix)."""
    if "seq" in message:         # the sequence number is always ours, and always last
        message = {k: v for k, v in message.items() if k != "seq"}
    body = json.dumps({**message, "v": VERSION}, separators=(",", ":"), allow_nan=False)
    return body[:-1].encode() + b',"seq":'


class Sealer:
    """Signs outgoing and checks incoming messages of one connection. A line is `<hmac hex> <json>`: the MAC
    covers the nonce and the exact JSON bytes, so each message is serialised once."""

    def __init__(self, token: str, nonce: str) -> None:
        self.key = bytes.fromhex(token)
        self.nonce = nonce.encode()
        self.sent = 0
        self.received = 0
        # HMAC-SHA256 = H(key^opad || H(key^ipad || nonce || data)): the hash states after the pads (and the
        # nonce) are computed once per connection, each message then costs two copy()s instead of hmac.new.
        key = self.key if len(self.key) <= _BLOCK else hashlib.sha256(self.key).digest()
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key) + self.nonce)
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def _mac(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest().encode()

    def seal(self, message: dict[str, Any]) -> bytes:
        return self.seal_prefix(encode_prefix(message))

    def seal_prefix(self, prefix: bytes) -> bytes:
        """Seal a message already encoded by encode_prefix()."""
        self.sent += 1
        data = b"%s%d}" % (prefix, self.sent)
        return self._mac(data) + b" " + data + b"\n"

    def open(self, line: bytes) -> dict[str, Any]:
        if len(line) > MAX_LINE:
            raise ProtocolError("message too long", size=len(line))
        mac, _, data = line.rstrip(b"\n").partition(b" ")
        if len(mac) != 64 or not hmac.compare_digest(mac, self._mac(data)):
            raise ProtocolError("bad or missing message authentication")
        message = parse_line(data)
        if message.get("seq") != self.received + 1:
            raise ProtocolError("message out of sequence (replayed or reordered)")
        self.received += 1
        return message


class LineReader:
    """Cuts a byte stream, fed in arbitrary chunks, into lines (without their newline). Bounded: a line that
    would not fit MAX_LINE with its newline raises ProtocolError as soon as it is known to be too long, so a
    peer can never make us hold more than one MAX_LINE of its data."""

    __slots__ = ("limit", "tail")

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self.tail = b""              # an unterminated line, waiting for the rest of it

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        chunk = self.tail + data if self.tail else bytes(data)
        lines = chunk.split(b"\n")
        self.tail = lines.pop()
        if len(self.tail) >= self.limit:
            raise ProtocolError("message too long", size=len(self.tail))
        for line in lines:
            if len(line) >= self.limit:
                raise ProtocolError("message too long", size=len(line) + 1)
        return lines


def parse_line(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError("message too long", size=len(line))
    try:
        text = line.decode() if isinstance(line, (bytes, bytearray)) else line
        if text[:1].isspace():           # whitespace around the object is fine, as with json.loads
            text = text.lstrip()
        message, end = _decode(text)
        if end != len(text) and not text[end:].isspace():
            raise ValueError(f"extra data at {end}")
    except (ValueError, RecursionError) as e:    # UnicodeDecodeError, JSONDecodeError, NaN, deep nesting
        raise ProtocolError(f"malformed message: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("message is not an object")
    if message.get("v") != VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r} not supported (want {VERSION})")
    if not isinstance(message.get("type"), str):
        raise ProtocolError("message has no type")
    if "seq" in message:
        validate.integer(message["seq"], "seq", 1, 2**62)
    return message


def open_challenge(line: bytes) -> str:
    """The coordinator's first line -> its nonce. Whoever answers on the port may send anything here."""
    first = parse_line(line)
    if first.get("type") != "challenge":
        raise ProtocolError("coordinator did not send a challenge")
    return validate.nonce(first.get("nonce"))


def challenge() -> bytes:
    return (json.dumps({"v": VERSION, "type": "challenge", "nonce": secrets.token_hex(16)}) + "\n").encode()
