"""Wire format between ranks and the coordinator: one JSON object per line, versioned, HMAC-SHA256
authenticated with the job's token (known only to the job's own wrappers, handed out by root agents),
bound to a per-connection nonce and a sequence number so messages cannot be replayed or reordered.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from slurmckpt.errors import ProtocolError

VERSION = 1
MAX_LINE = 64 * 1024

# Message types. Coordinator -> rank: commands; rank -> coordinator: replies and events.
COMMANDS = {"prepare", "capture", "resume", "finish", "abort", "welcome", "ack"}
EVENTS = {"hello", "ready", "captured", "failed", "done", "exited", "trigger", "started"}


def new_token() -> str:
    return secrets.token_hex(32)


class Sealer:
    """Signs outgoing and checks incoming messages of one connection. A line is `<hmac hex> <json>`: the MAC
    covers the nonce and the exact JSON bytes, so each message is serialised once."""

    def __init__(self, token: str, nonce: str) -> None:
        self.key = bytes.fromhex(token)
        self.nonce = nonce.encode()
        self.sent = 0
        self.received = 0

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self.key, self.nonce + data, hashlib.sha256).hexdigest().encode()

    def seal(self, message: dict) -> bytes:
        self.sent += 1
        data = json.dumps({**message, "v": VERSION, "seq": self.sent}, separators=(",", ":")).encode()
        return self._mac(data) + b" " + data + b"\n"

    def open(self, line: bytes) -> dict:
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


def parse_line(line: bytes) -> dict:
    if len(line) > MAX_LINE:
        raise ProtocolError("message too long", size=len(line))
    try:
        message = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"malformed message: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("message is not an object")
    if message.get("v") != VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r} not supported (want {VERSION})")
    if not isinstance(message.get("type"), str):
        raise ProtocolError("message has no type")
    return message


def challenge() -> bytes:
    return (json.dumps({"v": VERSION, "type": "challenge", "nonce": secrets.token_hex(16)}) + "\n").encode()
