"""The job's coordinator: runs epochs across every registered rank.

State machine of one epoch (any failure, timeout or vanished rank -> ABORT, previous commit stays):

    periodic: IDLE -> PREPARING (all READY: GPUs checkpointed, trees frozen) -> CAPTURING (all dumped)
              -> RESUMING (all thawed and sealed) -> COMMITTING (job manifest renamed) -> IDLE
    final:    IDLE -> PREPARING -> CAPTURING (dumped and sealed) -> COMMITTING -> FINISHING (trees killed)

The coordinator's own death never kills the job: ranks treat a lost connection as "no coordinator" and run on.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from slurmckpt.coordinator.protocol import MAX_LINE, Sealer, challenge, parse_line
from slurmckpt.errors import ProtocolError

log = logging.getLogger("slurmckpt.coordinator")

Committer = Callable[[int, dict, str], None]


class EpochFailed(Exception):
    def __init__(self, rank: str, stage: str, error: str) -> None:
        super().__init__(f"rank {rank} failed in {stage}: {error}")
        self.rank, self.stage, self.error = rank, stage, error


@dataclass
class RankConn:
    name: str
    node: str
    interval: int
    writer: asyncio.StreamWriter
    sealer: Sealer
    waiting: tuple[int, str, str, asyncio.Future] | None = None   # (epoch, reply, command, future)

    def send(self, message: dict) -> None:
        self.writer.write(self.sealer.seal(message))

    def expect(self, epoch: int, reply: str, command: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting = (epoch, reply, command, future)
        return future

    def deliver(self, msg: dict) -> None:
        """A reply to the current phase resolves its future; anything stale is ignored."""
        if self.waiting is None:
            return
        epoch, reply, command, future = self.waiting
        if future.done() or msg.get("epoch") != epoch:
            return
        if msg["type"] == "failed" and msg.get("phase") == command:
            future.set_exception(EpochFailed(self.name, str(msg.get("stage", command)), str(msg.get("error"))))
        elif msg["type"] == reply:
            future.set_result(msg)
        else:
            return
        self.waiting = None

    def vanish(self) -> None:
        if self.waiting and not self.waiting[3].done():
            self.waiting[3].set_exception(EpochFailed(self.name, self.waiting[2], "rank disconnected"))
        self.waiting = None


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
    finished: bool = False

    def __post_init__(self) -> None:
        self._epoch_lock = asyncio.Lock()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_LINE + 1)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for rank in list(self.ranks.values()):
            rank.writer.close()

    # ---- connections -----------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        hello = challenge()
        nonce = parse_line(hello)["nonce"]
        sealer = Sealer(self.token, nonce)
        rank: RankConn | None = None
        try:
            writer.write(hello)
            msg = sealer.open(await asyncio.wait_for(reader.readline(), 10))
            if msg["type"] != "hello" or not isinstance(msg.get("rank"), str):
                raise ProtocolError("expected hello")
            rank = RankConn(msg["rank"], str(msg.get("node", "?")), int(msg.get("interval", 0)), writer, sealer)
            step = rank.name.rpartition(".")[0]
            self.expected[step] = max(self.expected.get(step, 1), int(msg.get("tasks", 1)))
            old = self.ranks.get(rank.name)
            if old is not None:
                old.vanish()
            self.ranks[rank.name] = rank
            rank.send({"type": "welcome", "epoch": self.next_epoch})
            log.info("rank %s joined from %s (node %s)", rank.name, peer, rank.node)
            while line := await reader.readline():
                msg = sealer.open(line)
                await self._dispatch(rank, msg)
        except (ProtocolError, ValueError, asyncio.TimeoutError, asyncio.LimitOverrunError) as e:
            log.warning("connection from %s refused: %s", peer, e)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if rank is not None and self.ranks.get(rank.name) is rank:
                del self.ranks[rank.name]
                rank.vanish()
                log.info("rank %s left", rank.name)
            writer.close()

    async def _dispatch(self, rank: RankConn, msg: dict) -> None:
        kind = msg["type"]
        if kind in ("ready", "captured", "failed", "done"):
            rank.deliver(msg)
        elif kind == "exited":
            self.completed[rank.name] = {"kind": "completed", "exit_code": int(msg.get("exit_code", 0)),
                                         "node": rank.node}
        elif kind == "trigger":
            if self.on_trigger:
                self.on_trigger(str(msg.get("reason", "rank")), bool(msg.get("final", False)))
        elif kind == "started":
            if self.on_started:
                await self.on_started(rank.name, str(msg.get("action", "run")))
            rank.send({"type": "ack", "ref": msg.get("seq")})
        else:
            raise ProtocolError(f"unexpected message type {kind!r}")

    # ---- epochs ------------------------------------------------------------------------------------------
    async def run_epoch(self, reason: str, final: bool) -> dict:
        """One capture. GPU lock rounds (DESIGN.md): PREPARE locks every rank's GPUs concurrently with a short
        timeout; if a lock times out (a peer's NCCL collective is half done), the round aborts, which unlocks
        everyone, and retries after a jittered backoff; a cut exists only when every rank locked in the
        same round. Bounded by `lock_rounds`."""
        async with self._epoch_lock:
            if self.finished:
                return {"status": "skipped", "reason": reason, "why": "job already captured for requeue"}
            t0 = time.monotonic()
            for round_no in range(1, self.lock_rounds + 1):
                result = await self._attempt(reason, final)
                retry = (result["status"] == "aborted" and result.get("stage") in ("prepare", "gpu-lock")
                         and ("NOT_READY" in str(result.get("error")) or "lock" in str(result.get("error"))))
                if not retry or round_no == self.lock_rounds:
                    break
                log.info("lock round %d failed (%s); retrying", round_no, result.get("error"))
                await asyncio.sleep(self.lock_backoff_s * (1 + random.random()) * round_no)
            result["lock_rounds"] = round_no
            result["time_to_cut_s"] = (time.monotonic() - t0 - result.get("total_s", 0) + result.get("cut_s", 0)
                                       if result["status"] == "committed" else None)
            return result

    async def _attempt(self, reason: str, final: bool) -> dict:
        epoch = self.next_epoch
        self.next_epoch += 1
        parts = list(self.ranks.values())
        result = {"epoch": epoch, "reason": reason, "final": final, "ranks": len(parts)}
        t0 = time.monotonic()
        if not parts:
            return {**result, "status": "aborted", "error": "no rank registered"}
        missing = self.missing_ranks()
        if missing:   # never a partial set: a step that lost a rank cannot be captured consistently
            result.update(status="aborted", stage="membership",
                          error=f"rank(s) {', '.join(missing)} not connected; nothing was frozen")
            self.history.append(result)
            return result
        resumed, sealed = False, None
        try:
            await self._phase(parts, "prepare", "ready", epoch, self.prepare_timeout_s)
            result["cut_s"] = time.monotonic() - t0            # every rank frozen: the consistent cut
            captured = await self._phase(parts, "capture", "captured", epoch, self.capture_timeout_s,
                                         final=final)
            result["frozen_s"] = time.monotonic() - t0
            if not final:   # every rank dumped: thaw now, seal (checksum) after, then commit
                resumed = True
                sealed = await self._phase(parts, "resume", "done", epoch, self.capture_timeout_s)
            records = {**self.completed}
            for p, reply in zip(parts, captured):
                records[p.name] = {"kind": reply.get("kind", "image"), "node": p.node}
            await asyncio.get_running_loop().run_in_executor(None, self.committer, epoch, records, reason)
        except EpochFailed as e:
            log.error("epoch %d aborted: %s", epoch, e)
            if not resumed:
                await self._abort(parts, epoch)
            result.update(status="aborted", rank=e.rank, stage=e.stage, error=e.error)
        except asyncio.TimeoutError:
            if not resumed:
                await self._abort(parts, epoch)
            result.update(status="aborted", stage="timeout", error="a rank did not answer in time")
        except Exception as e:  # committer failure
            log.exception("epoch %d commit failed", epoch)
            if not resumed:
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
        futures = [p.expect(epoch, reply, command) for p in parts]     # armed before any reply can come
        for p in parts:
            p.send({"type": command, "epoch": epoch, **fields})
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), timeout)
        finally:
            for p, f in zip(parts, futures):
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()        # retrieved: a second failing rank is not an unhandled error
                if p.waiting and p.waiting[3] is f:
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
