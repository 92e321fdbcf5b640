"""A rank's side of the coordinator protocol: a blocking connection served by one thread of the wrapper."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable

from slurmckpt import validate
from slurmckpt.coordinator.protocol import MAX_LINE, Sealer, error_kind, open_challenge
from slurmckpt.errors import ProtocolError, is_retryable

log = logging.getLogger("slurmckpt.coordinator.client")

# command -> reply type when it succeeded
HANDSHAKE_S = 15
REPLIES = {"size": "sized", "prepare": "ready", "capture": "captured", "resume": "done", "finish": "done",
           "abort": "done", "pass-sigterm": "done"}


class RankClient:
    def __init__(self, host: str, port: int, token: str, rank: str, node: str, interval: int,
                 handler: Callable[[str, int, dict[str, Any]], dict[str, Any]], tasks: int = 1, last_epoch: int = 0,
                 gpus: bool = False) -> None:
        self.rank, self.handler = rank, handler
        self.sock = socket.create_connection((host, port), timeout=HANDSHAKE_S)
        # The whole handshake is bounded, not each read: a peer dribbling a byte at a time cannot hold us.
        cutoff = threading.Timer(HANDSHAKE_S, self._cut)
        cutoff.start()
        try:
            self._handshake(token, rank, node, interval, tasks, last_epoch, gpus)
        except BaseException:        # whatever answered there (a squatter on a dead coordinator's port)
            self.sock.close()
            raise
        finally:
            cutoff.cancel()
        self.closed = threading.Event()

    def _handshake(self, token: str, rank: str, node: str, interval: int, tasks: int, last_epoch: int,
                   gpus: bool) -> None:
        self.file = self.sock.makefile("rb")
        nonce = open_challenge(self.file.readline(MAX_LINE + 1))
        self.sealer = Sealer(token, nonce)
        self.peer = Sealer(token, nonce)
        self._lock = threading.Lock()
        self._acks = threading.Condition()
        self._acked: set[int] = set()
        self.send({"type": "hello", "rank": rank, "node": node, "interval": interval, "tasks": tasks,
                   "last_epoch": last_epoch, "gpus": gpus})
        welcome = self._read()
        if welcome.get("type") != "welcome":
            raise ProtocolError("coordinator refused the hello")
        self.sock.settimeout(None)

    def _cut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self) -> dict[str, Any]:
        line = self.file.readline(MAX_LINE + 1)
        if not line:
            raise EOFError("coordinator closed the connection")
        return self.peer.open(line)

    def send(self, message: dict[str, Any]) -> int:
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
                        self._acked.add(validate.integer(msg.get("ref"), "ref", 1, 2**62))
                        self._acks.notify_all()
                    continue
                if kind not in REPLIES:
                    log.warning("ignoring unexpected %s", kind)
                    continue
                epoch = validate.epoch(msg.get("epoch"))
                try:
                    reply = self.handler(kind, epoch, msg) or {}
                    self.send({"type": REPLIES[kind], "epoch": epoch, **reply})
                except Exception as e:  # reported to the coordinator, which aborts the epoch
                    # a retryable failure is one lock round of several: only the coordinator's verdict is news
                    log.log(logging.INFO if is_retryable(e) else logging.ERROR, "%s of epoch %d failed: %s",
                            kind, epoch, e)
                    stage = getattr(e, "context", {}).get("stage") or kind    # the rank's stage, if known
                    self.send({"type": "failed", "epoch": epoch, "phase": kind, "stage": str(stage)[:64],
                               "error": str(e), "error_kind": error_kind(e)})
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
