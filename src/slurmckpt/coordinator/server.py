"""The job's coordinator: runs epochs across every registered rank.

State machine of one epoch (any failure, timeout or vanished rank -> ABORT, previous commit stays):

    periodic: IDLE -> PREPARING (all READY: GPUs checkpointed, trees frozen) -> CAPTURING (all dumped to
              staging) -> RESUMING (all thawed, then persisted to the store) -> COMMITTING (job manifest
              renamed) -> IDLE
    final:    IDLE -> PREPARING -> CAPTURING (dumped and persisted) -> COMMITTING -> FINISHING (trees killed)

Epoch numbers come from `allocate` (the hosting agent: unique across the job's steps and coordinators).
A failure after the thaw still sends ABORT: ranks drop their persisted images of the uncommitted epoch.
The coordinator's own death never kills the job: ranks treat a lost connection as "no coordinator" and run on.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from slurmckpt.coordinator.protocol import (ERROR_KINDS, LineReader, Sealer, challenge, encode_prefix,
                                            parse_line)
from slurmckpt import validate
from slurmckpt.errors import ProtocolError

log = logging.getLogger("slurmckpt.coordinator")

FINAL_QUIET_S = 120.0      # after a final epoch, further final triggers are the same job ending
Committer = Callable[[int, dict, str], None]
Allocator = Callable[[int], int]          # at least this number -> the epoch to run (storage.allocate_epoch)


class EpochFailed(Exception):
    """`error_kind` (protocol.ERROR_KINDS): "retryable" only for a rank's failed PREPARE that said so."""

    def __init__(self, rank: str, stage: str, error: str, node: str = "?", error_kind: str = "fatal") -> None:
        super().__init__(f"rank {rank} (node {node}) failed in {stage}: {error}")
        self.rank, self.stage, self.error, self.node = rank, stage, error, node
        self.error_kind = error_kind


class _Barrier:
    """The replies of one phase: a single future, resolved when the last rank has answered or the first one
    failed. One future and one wake-up per phase instead of one per rank (asyncio.gather)."""

    __slots__ = ("future", "replies", "left")

    def __init__(self, n: int) -> None:
        self.future = asyncio.get_running_loop().create_future()
        self.replies: list[dict | None] = [None] * n
        self.left = n
        if n == 0:
            self.future.set_result(self.replies)

    def arrive(self, index: int, msg: dict) -> None:
        self.replies[index] = msg
        self.left -= 1
        if self.left == 0:
            self.future.set_result(self.replies)

    def fail(self, error: EpochFailed) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class RankConn:
    name: str
    node: str
    interval: int
    transport: asyncio.Transport
    sealer: Sealer
    waiting: tuple[int, str, str, _Barrier, int] | None = None   # (epoch, reply, command, barrier, index)

    def send(self, message: dict) -> None:
        self.transport.write(self.sealer.seal(message))

    def send_prefix(self, prefix: bytes) -> None:
        """Send a message encoded once for all ranks (protocol.encode_prefix); only seq and MAC are ours."""
        self.transport.write(self.sealer.seal_prefix(prefix))

    def expect(self, epoch: int, reply: str, command: str, barrier: _Barrier, index: int) -> None:
        self.waiting = (epoch, reply, command, barrier, index)

    def deliver(self, msg: dict) -> None:
        """A reply to the current phase counts towards its barrier; anything stale is ignored."""
        if self.waiting is None:
            return
        epoch, reply, command, barrier, index = self.waiting
        if barrier.future.done() or msg.get("epoch") != epoch:
            return
        if msg["type"] == "failed" and msg.get("phase") == command:
            kind = msg.get("error_kind", "fatal") if command == "prepare" else "fatal"   # a lock is in PREPARE
            barrier.fail(EpochFailed(self.name, str(msg.get("stage", command)), str(msg.get("error")),
                                     self.node, kind))
        elif msg["type"] == reply:
            barrier.arrive(index, msg)
        else:
            return
        self.waiting = None

    def vanish(self) -> None:
        if self.waiting:
            self.waiting[3].fail(EpochFailed(self.name, self.waiting[2], "rank disconnected", self.node))
        self.waiting = None


HELLO_TIMEOUT_S = 5         # a connection that has not authenticated by then is closed
MAX_PENDING = 1024          # unauthenticated connections at once; a new one beyond that evicts the oldest
LINGER_S = 2                # a refused peer gets this long to see our EOF before the socket is closed
READ_SIZE = 256 * 1024


def _reply(msg: dict) -> dict:
    """A rank's answer to a command, checked before it counts: epoch, and what a capture reports."""
    validate.epoch(msg.get("epoch"))
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


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection, driven by the event loop's callbacks: what a read brings is cut into lines,
    authenticated and handled right in buffer_updated. No stream, task or coroutine wake-up per connection
    or per line: at 1000+ ranks those were most of the coordinator's CPU."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.lines = LineReader()
        self.transport: asyncio.Transport | None = None
        self.peer: object = None
        self.sealer: Sealer | None = None
        self.rank: RankConn | None = None
        self.held: list[bytes] | None = None     # not None while an awaited handler runs: later lines wait
        self.eof = False
        self.closing = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        hello = challenge()
        self.sealer = Sealer(self.coord.token, parse_line(hello)["nonce"])
        self.coord._conns.add(self)
        self.coord._admit(self)
        transport.write(hello)
        self.timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._refuse, "no hello in time")

    def get_buffer(self, sizehint: int) -> memoryview:
        # One buffer for all connections: recv_into() a preallocated buffer instead of recv(256 KiB), which
        # allocates per read; safe to share because buffer_updated consumes it before the next read.
        return self.coord._rbuf

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:             # refused: what it still sends is read and dropped
            return
        try:
            lines = self.lines.feed(self.coord._rbuf[:nbytes])
        except ProtocolError as e:
            self._refuse(e)
            return
        self._process(lines)

    def eof_received(self) -> bool:
        if self.closing:
            return False
        if self.lines.tail:          # a last line without its newline still counts, as with readline()
            tail, self.lines.tail = self.lines.tail, b""
            self._process([tail])
        self.eof = True
        return self.held is not None      # half-open until the held lines are handled

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.coord._conns.discard(self)
        self.coord._pending.pop(self, None)
        self._drop()

    def _process(self, lines: list[bytes]) -> None:
        for i, line in enumerate(lines):
            if self.closing:
                return
            if self.held is not None:
                self.held.extend(lines[i:])
                return
            try:
                msg = self.sealer.open(line)
                if self.rank is None:
                    self.rank = self.coord._hello(self, msg)
                    self.timer.cancel()
                    self.coord._pending.pop(self, None)
                else:
                    pending = self.coord._dispatch(self.rank, msg)
                    if pending is not None:
                        self._hold(pending)
            except (ProtocolError, ValueError) as e:
                self._refuse(e)
            except Exception:    # a callback's bug: this connection goes, the coordinator stays
                log.exception("connection from %s dropped", self.peer)
                self._close()

    def _hold(self, pending: Awaitable[None]) -> None:
        """This rank's later messages wait until `pending` is done (in order, as a read loop would)."""
        self.held = []
        self.transport.pause_reading()        # what is held stays bounded by one read
        task = asyncio.get_running_loop().create_task(self._release(pending))
        self.coord._tasks.add(task)
        task.add_done_callback(self.coord._tasks.discard)

    async def _release(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception:
            log.exception("connection from %s dropped", self.peer)
            self._close()
            return
        held, self.held = self.held, None
        self._process(held)
        if self.held is None and not self.closing:
            if self.eof:
                self.transport.close()
            else:
                self.transport.resume_reading()

    def _refuse(self, reason: object) -> None:
        if not self.closing:
            log.warning("connection from %s refused: %s", self.peer, reason)
            self._close()

    def _close(self) -> None:
        """Drop the connection. Lingering: send EOF and read (and discard) until the peer's EOF or LINGER_S,
        since closing with unread input (the rest of an oversized line) would reset the connection instead."""
        self.closing = True
        self.timer.cancel()
        self._drop()          # now, not at connection_lost: an epoch must not wait for a dropped rank
        if self.transport.is_closing():
            return
        self.transport.resume_reading()
        self.transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def _drop(self) -> None:
        """Deregister this connection's rank (if it is still the registered one)."""
        rank = self.rank
        if rank is not None and self.coord.ranks.get(rank.name) is rank:
            del self.coord.ranks[rank.name]
            rank.vanish()
            log.info("rank %s left", rank.name)


@dataclass
class Coordinator:
    token: str
    committer: Committer
    next_epoch: int
    completed: dict[str, dict] = field(default_factory=dict)
    prepare_timeout_s: float = 30.0
    capture_timeout_s: float = 600.0
    on_started: Callable[[str, str], Awaitable[None]] | None = None
    on_trigger: Callable[[str, bool], None] | None = None
    ranks: dict[str, RankConn] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    expected: dict[str, int] = field(default_factory=dict)    # step -> number of tasks (from hellos)
    lock_rounds: int = 8
    lock_backoff_s: float = 0.2
    withdrawn: str = ""                  # set when a rank could not restore: no epoch may commit
    finished: bool = False
    max_pending: int = MAX_PENDING
    allocate: Allocator | None = None        # None: numbers counted here (one coordinator per job store)
    persist_timeout_s: float = 1800.0        # added to the phases that persist (resume; a final capture)

    def __post_init__(self) -> None:
        self._epoch_lock = asyncio.Lock()
        self._wanted: set[bool] = set()       # finality of the epochs queued or running
        self._final_tried = -FINAL_QUIET_S      # when the last final epoch ended (committed or not)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Connection] = set()
        self._pending: dict[_Connection, None] = {}     # not yet authenticated, oldest first
        self._tasks: set[asyncio.Task] = set()
        self._rbuf = memoryview(bytearray(READ_SIZE))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on `host`: the job's own address (loopback for a one-node job), never every interface."""
        # backlog: a whole job's ranks connect at once (job start, coordinator restart)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), host, port, backlog=4096)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for conn in list(self._conns):
            conn.transport.close()

    # ---- connections -----------------------------------------------------------------------------------
    def _admit(self, conn: _Connection) -> None:
        """Anyone on the node can connect: at most max_pending connections wait for their hello (each for
        HELLO_TIMEOUT_S); beyond that the oldest waiting one goes (a rank says hello within a round trip)."""
        self._pending[conn] = None
        while len(self._pending) > self.max_pending:
            oldest = next(iter(self._pending))
            self._pending.pop(oldest)
            log.warning("connection from %s dropped: %d unauthenticated connections", oldest.peer,
                        self.max_pending)
            oldest.closing = True
            if oldest.timer is not None:
                oldest.timer.cancel()
            if oldest.transport is not None:
                oldest.transport.abort()

    def _hello(self, conn: _Connection, msg: dict) -> RankConn:
        """A connection's first authenticated message must be its rank's hello."""
        if msg["type"] != "hello":
            raise ProtocolError("expected hello")
        step, _ = validate.rank_name(msg.get("rank"))
        tasks = validate.integer(msg.get("tasks", 1), "tasks", 1, validate.MAX_TASKS)
        rank = RankConn(msg["rank"], validate.hostname(msg.get("node", "unknown")),
                        validate.integer(msg.get("interval", 0), "interval", 0, validate.MAX_INTERVAL_S),
                        conn.transport, conn.sealer)
        last = validate.integer(msg.get("last_epoch", 0), "last_epoch", 0, validate.MAX_EPOCH)
        self.expected[step] = max(self.expected.get(step, 1), tasks)
        if last >= self.next_epoch:   # a restarted coordinator never reuses an epoch a rank has seen
            self.next_epoch = last + 1
        old = self.ranks.get(rank.name)
        if old is not None:
            old.vanish()
        self.ranks[rank.name] = rank
        rank.send({"type": "welcome", "epoch": self.next_epoch})
        log.info("rank %s joined from %s (node %s)", rank.name, conn.peer, rank.node)
        return rank

    def _dispatch(self, rank: RankConn, msg: dict) -> Awaitable[None] | None:
        """Handle one message of a registered rank. Returns an awaitable when handling must wait for a
        callback (`started`); that rank's later messages are held until it is done."""
        kind = msg["type"]
        if kind in ("ready", "captured", "failed", "done"):
            rank.deliver(_reply(msg))
        elif kind == "exited":
            self.completed[rank.name] = {"kind": "completed", "node": rank.node,
                                         "exit_code": validate.integer(msg.get("exit_code", 0), "exit_code",
                                                                       -255, 255)}
        elif kind == "trigger":
            reason = validate.label(msg.get("reason", "rank"), "reason")
            final = validate.flag(msg.get("final", False), "final")
            if self.on_trigger:
                self.on_trigger(reason, final)
        elif kind == "withdrawn":   # a rank could not restore: the running ranks are at no common cut
            epoch = validate.epoch(msg.get("epoch"))
            self.withdrawn = (f"rank {rank.name} (node {rank.node}) could not restore epoch {epoch}; "
                              "the job is being requeued to restart every rank from one older checkpoint")
            log.error("%s", self.withdrawn)
        elif kind == "started":
            validate.label(msg.get("action", "run"), "action")
            if self.on_started:
                return self._started(rank, msg)
            rank.send({"type": "ack", "ref": msg.get("seq")})
        else:
            raise ProtocolError(f"unexpected message type {kind!r}")
        return None

    async def _started(self, rank: RankConn, msg: dict) -> None:
        await self.on_started(rank.name, str(msg.get("action", "run")))
        rank.send({"type": "ack", "ref": msg.get("seq")})

    # ---- epochs ------------------------------------------------------------------------------------------
    async def run_epoch(self, reason: str, final: bool) -> dict:
        """One capture. GPU lock rounds (docs/architecture.md): PREPARE locks every rank's GPUs concurrently with a short
        timeout; if a lock times out (a peer's NCCL collective is half done), the round aborts, which unlocks
        everyone, and retries after a jittered backoff; a cut exists only when every rank locked in the
        same round. Bounded by `lock_rounds`. Retried only when the failing rank typed its error retryable
        (`error_kind`, errors.LockContended), never because of what the error's text says."""
        if final in self._wanted:   # every rank's SIGTERM asks for the same final capture: one serves all
            return {"status": "skipped", "reason": reason, "why": "a capture of the same kind is under way"}
        if final and time.monotonic() - self._final_tried < FINAL_QUIET_S:
            # Slurm's kill sequence signals more than once: another frozen attempt would only eat KillWait
            return {"status": "skipped", "reason": reason, "why": "a final capture was just attempted"}
        self._wanted.add(final)
        try:
            return await self._run_epoch(reason, final)
        finally:
            self._wanted.discard(final)
            if final:
                self._final_tried = time.monotonic()

    async def _run_epoch(self, reason: str, final: bool) -> dict:
        async with self._epoch_lock:
            if self.finished:
                return {"status": "skipped", "reason": reason, "why": "job already captured for requeue"}
            if self.withdrawn:     # capturing now would commit a state that is no moment of the computation
                return {"status": "skipped", "reason": reason, "why": self.withdrawn}
            t0 = time.monotonic()
            for round_no in range(1, self.lock_rounds + 1):
                result = await self._attempt(reason, final)
                retry = result["status"] == "aborted" and result.get("error_kind") == "retryable"
                if not retry or round_no == self.lock_rounds:
                    break
                log.info("lock round %d failed (%s); retrying", round_no, result.get("error"))
                await asyncio.sleep(self.lock_backoff_s * (1 + random.random()) * round_no)
            result["lock_rounds"] = round_no
            result["time_to_cut_s"] = (time.monotonic() - t0 - result.get("total_s", 0) + result.get("cut_s", 0)
                                       if result["status"] == "committed" else None)
            return result

    async def _new_epoch(self) -> int:
        epoch = self.next_epoch
        if self.allocate is not None:
            epoch = await asyncio.get_running_loop().run_in_executor(None, self.allocate, self.next_epoch)
        self.next_epoch = max(self.next_epoch, epoch + 1)
        return epoch

    async def _attempt(self, reason: str, final: bool) -> dict:
        parts = list(self.ranks.values())
        result = {"epoch": self.next_epoch, "reason": reason, "final": final, "ranks": len(parts)}
        t0 = time.monotonic()
        if not parts:
            return {**result, "status": "aborted", "error": "no rank registered"}
        try:
            epoch = result["epoch"] = await self._new_epoch()
        except Exception as e:  # the store could not give a number: nothing was frozen
            log.error("no epoch number: %s", e)
            result.update(status="aborted", stage="allocate", error=f"no epoch number from the image store: {e}")
            self.history.append(result)
            return result
        missing = self.missing_ranks()
        if missing:   # never a partial set: a step that lost a rank cannot be captured consistently
            result.update(status="aborted", stage="membership",
                          error=f"rank(s) {', '.join(missing)} not connected; nothing was frozen")
            self.history.append(result)
            return result
        sealed = None
        try:
            # final and trigger tell a rank's agent what it records if its part fails (fresh_start.py)
            await self._phase(parts, "prepare", "ready", epoch, self.prepare_timeout_s, final=final,
                              trigger=reason)
            result["cut_s"] = time.monotonic() - t0            # every rank frozen: the consistent cut
            persist_s = self.capture_timeout_s + self.persist_timeout_s
            captured = await self._phase(parts, "capture", "captured", epoch,
                                         persist_s if final else self.capture_timeout_s, final=final)
            result["frozen_s"] = time.monotonic() - t0
            if not final:   # every rank dumped: thaw now, persist (compress, copy to the store) after, commit
                sealed = await self._phase(parts, "resume", "done", epoch, persist_s)
            records = {**self.completed}
            for p, reply in zip(parts, captured):
                records[p.name] = {"kind": reply.get("kind", "image"), "node": p.node}
            await asyncio.get_running_loop().run_in_executor(None, self.committer, epoch, records, reason)
        except EpochFailed as e:
            log.error("epoch %d aborted: %s", epoch, e)
            await self._abort(parts, epoch)
            result.update(status="aborted", rank=e.rank, node=e.node, stage=e.stage, error=e.error,
                          error_kind=e.error_kind)
        except asyncio.TimeoutError:
            await self._abort(parts, epoch)
            result.update(status="aborted", stage="timeout", error="a rank did not answer in time")
        except Exception as e:  # committer failure
            log.exception("epoch %d commit failed", epoch)
            await self._abort(parts, epoch)
            result.update(status="aborted", stage="commit", error=str(e))
        else:
            result["commit_s"] = time.monotonic() - t0
            if final:
                self.finished = True
                try:
                    await self._phase(parts, "finish", "done", epoch, 60)
                except (EpochFailed, asyncio.TimeoutError) as e:
                    log.warning("epoch %d committed but finish did not complete: %s", epoch, e)
            result.update(status="committed", total_s=time.monotonic() - t0,
                          bytes=sum(int(r.get("bytes", 0)) for r in (sealed or captured)))
        self.history.append(result)
        return result

    async def _phase(self, parts: list[RankConn], command: str, reply: str, epoch: int,
                     timeout: float, **fields: object) -> list[dict]:
        for p in parts:     # a rank that left between two phases fails this one now, not at its timeout
            if self.ranks.get(p.name) is not p:
                raise EpochFailed(p.name, command, "rank disconnected", p.node)
        barrier = _Barrier(len(parts))
        for index, p in enumerate(parts):       # armed before any reply can come
            p.expect(epoch, reply, command, barrier, index)
        prefix = encode_prefix({"type": command, "epoch": epoch, **fields})   # one JSON encoding for all
        for p in parts:
            p.send_prefix(prefix)
        try:
            return await asyncio.wait_for(barrier.future, timeout)
        finally:
            for p in parts:
                if p.waiting and p.waiting[3] is barrier:
                    p.waiting = None

    async def _abort(self, parts: list[RankConn], epoch: int) -> None:
        live = [p for p in parts if self.ranks.get(p.name) is p]
        try:
            await self._phase(live, "abort", "done", epoch, 30)
        except (EpochFailed, asyncio.TimeoutError) as e:
            log.warning("abort of epoch %d incomplete: %s", epoch, e)

    def missing_ranks(self) -> list[str]:
        present = set(self.ranks) | set(self.completed)
        missing = []
        for step, n in sorted(self.expected.items()):
            have = {name for name in present if name.rpartition(".")[0] == step}
            if len(have) < n:
                missing += [f"{step}.{r}" for r in range(n) if f"{step}.{r}" not in have][: n - len(have)]
        return missing

    @property
    def interval_s(self) -> int:
        values = [r.interval for r in self.ranks.values() if r.interval > 0]
        return min(values, default=0)
