"""A rank's side of the coordinator protocol: a blocking connection served by one thread of the wrapper."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from slurmckpt.coordinator.protocol import MAX_LINE, Sealer, parse_line
from slurmckpt.errors import ProtocolError

log = logging.getLogger("slurmckpt.coordinator.client")

# command -> reply type when it succeeded
REPLIES = {"prepare": "ready", "capture": "captured", "resume": "done", "finish": "done", "abort": "done"}


class RankClient:
    def __init__(self, host: str, port: int, token: str, rank: str, node: str, interval: int,
                 handler: Callable[[str, int, dict], dict], tasks: int = 1, last_epoch: int = 0) -> None:
        self.rank, self.handler = rank, handler
        self.sock = socket.create_connection((host, port), timeout=15)
        self.file = self.sock.makefile("rb")
        first = parse_line(self.file.readline(MAX_LINE + 1))
        if first.get("type") != "challenge":
            raise ProtocolError("coordinator did not send a challenge")
        self.sealer = Sealer(token, first["nonce"])
        self.peer = Sealer(token, first["nonce"])
        self._lock = threading.Lock()
        self._acks = threading.Condition()
        self._acked: set[int] = set()
        self.send({"type": "hello", "rank": rank, "node": node, "interval": interval, "tasks": tasks,
                   "last_epoch": last_epoch})
        welcome = self._read()
        if welcome.get("type") != "welcome":
            raise ProtocolError("coordinator refused the hello")
        self.sock.settimeout(None)
        self.closed = threading.Event()

    def _read(self) -> dict:
        line = self.file.readline(MAX_LINE + 1)
        if not line:
            raise EOFError("coordinator closed the connection")
        return self.peer.open(line)

    def send(self, message: dict) -> int:
        with self._lock:
            self.sock.sendall(self.sealer.seal(message))
            return self.sealer.sent

    def serve_forever(self) -> None:
        """Run commands as they come; each one is answered with its reply type or `failed`."""
        try:
            while True:
                msg = self._read()
                kind = msg["type"]
                if kind == "ack":
                    with self._acks:
                        self._acked.add(int(msg.get("ref", 0)))
                        self._acks.notify_all()
                    continue
                if kind not in REPLIES:
                    log.warning("ignoring unexpected %s", kind)
                    continue
                epoch = int(msg["epoch"])
                try:
                    reply = self.handler(kind, epoch, msg) or {}
                    self.send({"type": REPLIES[kind], "epoch": epoch, **reply})
                except Exception as e:  # reported to the coordinator, which aborts the epoch
                    log.error("%s of epoch %d failed: %s", kind, epoch, e)
                    self.send({"type": "failed", "epoch": epoch, "phase": kind, "stage": kind, "error": str(e)})
        except (EOFError, OSError, ProtocolError) as e:
            log.info("coordinator connection lost: %s", e)
        finally:
            self.closed.set()

    def event(self, kind: str, wait_ack: bool = False, timeout: float = 30.0, **fields: object) -> None:
        seq = self.send({"type": kind, **fields})
        if wait_ack:
            with self._acks:
                self._acks.wait_for(lambda: seq in self._acked or self.closed.is_set(), timeout)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
