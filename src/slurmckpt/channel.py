"""Framed JSON messages over a unix stream socket, with file descriptors attached (SCM_RIGHTS).

Used between the user-side wrapper and its root agent. Frames are bounded: a peer that sends an oversized
or malformed frame gets a ProtocolError, never a crash of the receiver.
"""
from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any

from slurmckpt.errors import ProtocolError
from slurmckpt.validate import loads

MAX_FRAME = 4 * 1024 * 1024   # argv + environment of a task fit easily
MAX_FDS = 8
_HEADER = struct.Struct("!I")


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def from_fd(cls, fd: int) -> "Channel":
        return cls(socket.socket(fileno=fd))

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
        except ValueError as e:          # NaN/Infinity: the receiver would refuse it
            raise ProtocolError(f"message not sendable: {e}") from e
        if len(body) > MAX_FRAME:
            raise ProtocolError("message too large", size=len(body))
        frame = _HEADER.pack(len(body)) + body
        if fds:
            self.sock.sendmsg([frame[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            self.sock.sendall(frame[1:])
        else:
            self.sock.sendall(frame)

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """One message and the fds that came with it. Raises EOFError when the peer closed."""
        fds: list[int] = []
        first, anc, _flags, _addr = self.sock.recvmsg(1, socket.CMSG_SPACE(MAX_FDS * 4))
        if not first:
            raise EOFError("peer closed the channel")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[: len(data) - (len(data) % got.itemsize)])
                fds.extend(got)
        try:
            header = first + self._read_exact(_HEADER.size - 1)
            (length,) = _HEADER.unpack(header)
            if length > MAX_FRAME:
                raise ProtocolError("oversized frame", size=length)   # stream now out of sync: caller closes
            body = self._read_exact(length)
            try:
                message = loads(body)        # NaN/Infinity and too-deep nesting refused here
            except ValueError as e:
                raise ProtocolError(f"malformed frame: {e}") from e
            if not isinstance(message, dict):
                raise ProtocolError("frame is not an object")
        except BaseException:
            for fd in fds:        # never leak what a rejected frame carried
                _close(fd)
            raise
        return message, fds

    def _read_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                raise EOFError("peer closed mid-frame")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict[str, Any]:
        """Request/response. An error reply becomes the exception class it names."""
        self.send({"op": op, **args}, fds)
        reply, extra = self.recv()
        for fd in extra:   # replies never carry fds; don't leak any a peer sent
            _close(fd)
        if not reply.get("ok", False):
            from slurmckpt import errors
            cls = getattr(errors, str(reply.get("error_type", "SlurmckptError")), errors.SlurmckptError)
            if not (isinstance(cls, type) and issubclass(cls, errors.SlurmckptError)):
                cls = errors.SlurmckptError
            stage = reply.get("stage")          # the rank's stage that failed, for a capture phase
            raise cls(str(reply.get("error", "agent error")), op=op,
                      stage=stage if isinstance(stage, str) and stage else None)
        return reply

    def close(self) -> None:
        self.sock.close()


def _close(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError:
        pass
