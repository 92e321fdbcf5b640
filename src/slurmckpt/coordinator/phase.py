"""One phase of an epoch as the coordinator waits for it: each registered rank's connection, the replies of
the phase (all, or the first failure), the checks a reply passes before it counts, and the error that
aborts the epoch naming rank, node, stage and reason.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from slurmckpt import validate
from slurmckpt.coordinator.budget import RankSize
from slurmckpt.coordinator.protocol import ERROR_KINDS, Sealer
from slurmckpt.errors import ProtocolError


def rank_list(parts: list[RankConn], limit: int = 8) -> str:
    shown = ", ".join(f"rank {p.name} (node {p.node})" for p in parts[:limit])
    return shown + (f" and {len(parts) - limit} more" if len(parts) > limit else "")


class EpochFailed(Exception):
    """`error_kind` (protocol.ERROR_KINDS): "retryable" only for a rank's failed PREPARE that said so."""

    def __init__(self, rank: str, stage: str, error: str, node: str = "?", error_kind: str = "fatal") -> None:
        super().__init__(f"rank {rank} (node {node}) failed in {stage}: {error}")
        self.rank, self.stage, self.error, self.node = rank, stage, error, node
        self.error_kind = error_kind


class PhaseReplies:
    """The replies of one phase: a single future, resolved when the last rank has answered or the first one
    failed. One future and one wake-up per phase instead of one per rank (asyncio.gather). `collect`: a
    failure counts as that rank's answer (an abort waits for every rank's word, failed or not)."""

    __slots__ = ("future", "replies", "left", "collect")

    def __init__(self, n: int, collect: bool = False) -> None:
        self.future = asyncio.get_running_loop().create_future()
        self.replies: list[dict[str, Any] | EpochFailed | None] = [None] * n
        self.left = n
        self.collect = collect
        if n == 0:
            self.future.set_result(self.replies)

    def arrive(self, index: int, msg: dict[str, Any] | EpochFailed) -> None:
        if self.future.done():
            return
        self.replies[index] = msg
        self.left -= 1
        if self.left == 0:
            self.future.set_result(self.replies)

    def fail(self, index: int, error: EpochFailed) -> None:
        if self.collect:
            self.arrive(index, error)
        elif not self.future.done():
            self.future.set_exception(error)

    def silent(self, parts: list[RankConn]) -> list[RankConn]:
        return [p for p, r in zip(parts, self.replies) if r is None]


@dataclass(frozen=True)
class Expected:
    """The reply a rank owes the current phase, and where it counts."""
    epoch: int
    reply: str                 # the reply's type ("sized", "captured", ...)
    command: str               # the phase's command (a failure names it, or the rank's stage)
    barrier: PhaseReplies
    index: int                 # the rank's place in the barrier


@dataclass
class RankConn:
    name: str
    node: str
    interval: int              # seconds; 0 none; duration.AUTO: the interval the coordinator chooses
    transport: asyncio.Transport
    sealer: Sealer
    waiting: Expected | None = None
    gpus: bool = False         # the task has GPUs (its hello): epochs of such a job start with SIZE

    def send(self, message: dict[str, Any]) -> None:
        self.transport.write(self.sealer.seal(message))

    def send_prefix(self, prefix: bytes) -> None:
        """Send a message encoded once for all ranks (protocol.encode_prefix); only seq and MAC are ours."""
        self.transport.write(self.sealer.seal_prefix(prefix))

    def expect(self, epoch: int, reply: str, command: str, barrier: PhaseReplies, index: int) -> None:
        self.waiting = Expected(epoch, reply, command, barrier, index)

    def deliver(self, msg: dict[str, Any]) -> None:
        """A reply to the current phase counts towards its barrier; anything stale is ignored."""
        if self.waiting is None:
            return
        w = self.waiting
        if w.barrier.future.done() or msg.get("epoch") != w.epoch:
            return
        if msg["type"] == "failed" and msg.get("phase") == w.command:
            kind = msg.get("error_kind", "fatal")
            if kind == "retryable" and w.command != "prepare":      # a lock is in PREPARE only
                kind = "fatal"
            w.barrier.fail(w.index, EpochFailed(self.name, str(msg.get("stage", w.command)), str(msg.get("error")),
                                                self.node, kind))
        elif msg["type"] == w.reply:
            w.barrier.arrive(w.index, msg)
        else:
            return
        self.waiting = None

    def vanish(self) -> None:
        if self.waiting:
            w = self.waiting
            w.barrier.fail(w.index, EpochFailed(self.name, w.command, "rank disconnected", self.node))
        self.waiting = None


def check_reply(msg: dict[str, Any]) -> dict[str, Any]:
    """A rank's answer to a command, checked before it counts: epoch, and what a capture reports."""
    validate.epoch(msg.get("epoch"))
    if msg["type"] == "sized":
        RankSize.from_reply("", "", msg)
    if msg["type"] == "captured" and msg.get("kind", "image") not in ("image", "replay"):
        raise ProtocolError(f"bad kind {msg.get('kind')!r}: not image or replay")
    if "bytes" in msg:
        validate.integer(msg["bytes"], "bytes", 0, 2**62)
    if msg["type"] == "failed":
        for name in ("phase", "stage", "error"):
            validate.text(msg.get(name, ""), name)
        if msg.get("error_kind", "fatal") not in ERROR_KINDS:
            raise ProtocolError(f"bad error_kind {msg.get('error_kind')!r}: not one of {', '.join(ERROR_KINDS)}")
    return msg
