"""The job's coordinator: runs epochs across every registered rank.

State machine of one epoch (any failure, timeout or vanished rank -> ABORT, previous commit stays):

    periodic: IDLE -> SIZING (all SIZED: bytes measured, nothing locked) -> PREPARING (all READY: GPUs
              checkpointed, trees frozen) -> CAPTURING (all dumped to staging) -> RESUMING (all thawed, then
              persisted to the store) -> COMMITTING (job manifest renamed) -> IDLE
    final:    IDLE -> SIZING -> PREPARING -> CAPTURING (dumped into staging, handed to persisters that
              outlive the job) -> COMMITTING (hand-over recorded: store/handover.py commits the epoch once
              every rank's images are in the store) -> FINISHING (trees killed)

SIZING (jobs with GPUs: a rank's hello says so; every final epoch) refuses, before anything is locked, GPU
copies that do not fit the host memory of ranks sharing a node or a memory cgroup, and a final capture that
does not fit in what is left of Slurm's window (each rank's agent judges its own: agent/window.py), and sets
this epoch's phase timeouts from the bytes (budget.py); the phases that persist get persist_timeout_s on top.
Every abort names the rank, node, phase and reason; a timeout names every rank that had not answered. An abort goes to every rank also
after the thaw, so that ranks drop the images they persisted of an epoch that will not commit.

Epoch numbers come from `allocate` (the hosting agent: unique across the job's steps and coordinators).
A failure after the thaw still sends ABORT: ranks drop their persisted images of the uncommitted epoch.
The coordinator's own death never kills the job: ranks treat a lost connection as "no coordinator" and run on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from slurmckpt.coordinator.budget import PhaseTimeouts, RankSize, refusals
from slurmckpt.coordinator.connection import MAX_PENDING, READ_SIZE, Connection
from slurmckpt.barrier.rounds import LockRounds
from slurmckpt.coordinator.phase import EpochFailed, PhaseReplies, RankConn, check_reply, rank_list
from slurmckpt.coordinator.protocol import encode_prefix
from slurmckpt import validate
from slurmckpt.duration import AUTO
from slurmckpt.errors import ProtocolError
from slurmckpt.identity import RankName

log = logging.getLogger("slurmckpt.coordinator")

FINAL_QUIET_S = 120.0      # after a final epoch, further final triggers are the same job ending
PASS_ON_WAIT_S = 5.0       # how long the ranks' word that they passed the SIGTERM on is waited for


class Committer(Protocol):
    """(epoch, every rank's record, reason, final) -> None; raises when the commit failed. A final epoch is
    handed over, not committed: its ranks' persisters commit it after the job ended (store/handover.py)."""
    def __call__(self, epoch: int, ranks: dict[str, Any], reason: str, final: bool = False) -> None: ...


class Allocator(Protocol):
    """At least this number -> the epoch to run (storage.allocate_epoch); `final` recorded for the next run."""
    def __call__(self, at_least: int, final: bool = False) -> int: ...


@dataclass
class Coordinator:
    token: str
    committer: Committer
    next_epoch: int
    completed: dict[str, dict[str, Any]] = field(default_factory=dict)
    prepare_timeout_s: float = 30.0
    capture_timeout_s: float = 600.0
    on_started: Callable[[str, str], Awaitable[None]] | None = None
    on_trigger: Callable[[str, bool], None] | None = None
    ranks: dict[str, RankConn] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
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
        self._conns: set[Connection] = set()
        self._pending: dict[Connection, None] = {}     # not yet authenticated, oldest first
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rbuf = memoryview(bytearray(READ_SIZE))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on `host`: the job's own address (loopback for a one-node job), never every interface."""
        # backlog: a whole job's ranks connect at once (job start, coordinator restart)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Connection(self), host, port, backlog=4096)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for conn in list(self._conns):
            conn.transport.close()

    # ---- connections -----------------------------------------------------------------------------------
    def _admit(self, conn: Connection) -> None:
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

    def _hello(self, conn: Connection, msg: dict[str, Any]) -> RankConn:
        """A connection's first authenticated message must be its rank's hello."""
        if msg["type"] != "hello":
            raise ProtocolError("expected hello")
        step, _ = validate.rank_name(msg.get("rank"))
        tasks = validate.integer(msg.get("tasks", 1), "tasks", 1, validate.MAX_TASKS)
        rank = RankConn(msg["rank"], validate.hostname(msg.get("node", "unknown")),
                        validate.integer(msg.get("interval", 0), "interval", AUTO, validate.MAX_INTERVAL_S),
                        conn.transport, conn.sealer, gpus=validate.flag(msg.get("gpus", False), "gpus"))
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

    def _dispatch(self, rank: RankConn, msg: dict[str, Any]) -> Awaitable[None] | None:
        """Handle one message of a registered rank. Returns an awaitable when handling must wait for a
        callback (`started`); that rank's later messages are held until it is done."""
        kind = msg["type"]
        if kind in ("sized", "ready", "captured", "failed", "done"):
            rank.deliver(check_reply(msg))
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

    async def _started(self, rank: RankConn, msg: dict[str, Any]) -> None:
        if self.on_started is not None:
            await self.on_started(rank.name, str(msg.get("action", "run")))
        rank.send({"type": "ack", "ref": msg.get("seq")})

    # ---- epochs ------------------------------------------------------------------------------------------
    async def run_epoch(self, reason: str, final: bool) -> dict[str, Any]:
        """One capture. GPU lock rounds (docs/architecture.md): PREPARE locks every rank's GPUs concurrently with a short
        timeout; if a lock times out (a peer's NCCL collective is half done), the round aborts, which unlocks
        everyone, and retries after a jittered backoff; a cut exists only when every rank locked in the
        same round. Bounded by `lock_rounds`. Retried only when the failing rank typed its error retryable
        (`error_kind`: errors.LockContended, errors.ExchangeInFlight), never because of the error's text."""
        if final in self._wanted:   # every rank's SIGTERM asks for the same final capture: one serves all
            return {"status": "skipped", "reason": reason, "why": "a capture of the same kind is under way"}
        if final and time.monotonic() - self._final_tried < FINAL_QUIET_S:
            # Slurm's kill sequence signals more than once: another frozen attempt would only eat KillWait
            return {"status": "skipped", "reason": reason, "why": "a final capture was just attempted"}
        self._wanted.add(final)
        try:
            result = await self._run_epoch(reason, final, time.monotonic())
        finally:
            self._wanted.discard(final)
            if final:
                self._final_tried = time.monotonic()
        # no final capture at Slurm's SIGTERM: it failed, or none may be taken (a rank withdrew the restored cut)
        if final and reason == "sigterm" and (result.get("status") == "aborted" or self.withdrawn):
            await self._pass_sigterm_on(int(result.get("epoch", self.next_epoch)))
        return result

    async def _pass_sigterm_on(self, epoch: int) -> None:
        """The final capture at Slurm's SIGTERM failed: every rank is told, so that each passes the signal on
        to its program (task/wrapper.py) instead of holding it until KillWait's SIGKILL; the host's wrapper
        also learns it from the result. Whatever a rank answers, or not within a few seconds, changes nothing."""
        live = list(self.ranks.values())
        if not live:
            return
        barrier = self._send(live, "pass-sigterm", "done", epoch, collect=True)
        try:
            await asyncio.wait_for(asyncio.shield(barrier.future), PASS_ON_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("epoch %d: not every rank confirmed passing Slurm's SIGTERM on", epoch)
        finally:
            self._disarm(live, barrier)

    async def _run_epoch(self, reason: str, final: bool, triggered: float) -> dict[str, Any]:
        """`triggered`: when the trigger reached this coordinator (a final epoch's ranks judge what is left of
        Slurm's window from it: agent/window.py)."""
        async with self._epoch_lock:
            if self.finished:
                return {"status": "skipped", "reason": reason, "why": "job already captured for requeue"}
            if self.withdrawn:     # capturing now would commit a state that is no moment of the computation
                return {"status": "skipped", "reason": reason, "why": self.withdrawn}
            t0 = time.monotonic()
            rounds = LockRounds(self.lock_rounds, self.lock_backoff_s)
            result, round_no = await rounds.run(lambda: self._attempt(reason, final, triggered))
            result["lock_rounds"] = round_no
            result["time_to_cut_s"] = (time.monotonic() - t0 - result.get("total_s", 0) + result.get("cut_s", 0)
                                       if result["status"] == "committed" else None)
            return result

    async def _new_epoch(self, final: bool) -> int:
        epoch, allocate, at_least = self.next_epoch, self.allocate, self.next_epoch
        if allocate is not None:
            epoch = await asyncio.get_running_loop().run_in_executor(
                None, lambda: allocate(at_least, final=True) if final else allocate(at_least))
        self.next_epoch = max(self.next_epoch, epoch + 1)
        return epoch

    async def _attempt(self, reason: str, final: bool, triggered: float) -> dict[str, Any]:
        parts = list(self.ranks.values())
        result = {"epoch": self.next_epoch, "reason": reason, "final": final, "ranks": len(parts)}
        t0 = time.monotonic()
        if not parts:
            return {**result, "status": "aborted", "error": "no rank registered"}
        try:
            epoch = result["epoch"] = await self._new_epoch(final)
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
        sealed, phase = None, "size"
        timeouts = PhaseTimeouts.derive([], self.prepare_timeout_s, self.capture_timeout_s)
        try:
            # final and trigger tell a rank's agent what it records if its part fails (fresh_start.py)
            sizes = await self._size(parts, epoch, final, reason, triggered)
            result.update(gpu_bytes=sum(r.gpu_bytes for r in sizes), image_bytes=sum(r.image_bytes for r in sizes))
            for size, why in refusals(sizes)[:1]:     # nothing is locked yet: refused up front
                raise EpochFailed(size.rank, "size", f"capture refused before anything was locked: {why}",
                                  size.node)
            timeouts = PhaseTimeouts.derive(sizes, self.prepare_timeout_s, self.capture_timeout_s)
            result["timeouts"] = timeouts.as_dict()
            phase, frozen_at = "prepare", time.monotonic()
            await self._phase(parts, "prepare", "ready", epoch, timeouts.prepare, final=final, trigger=reason)
            result["cut_s"] = time.monotonic() - t0            # every rank frozen: the consistent cut
            phase = "capture"
            capture_s = timeouts.capture + (self.persist_timeout_s if final else 0)
            captured = await self._phase(parts, "capture", "captured", epoch, capture_s, final=final,
                                         timeout_s=capture_s)
            result["frozen_s"] = time.monotonic() - t0
            # what the tasks lost: frozen from PREPARE until every rank dumped (RESUME thaws them now; the
            # persist runs beside them): C of the automatic interval (coordinator/interval.py)
            result["stall_s"] = time.monotonic() - frozen_at
            if not final:   # every rank dumped: thaw now, persist (compress, copy to the store) after, commit
                phase = "resume"
                sealed = await self._phase(parts, "resume", "done", epoch, timeouts.resume + self.persist_timeout_s)
            records = {**self.completed}
            for p, reply in zip(parts, captured):
                records[p.name] = {"kind": reply.get("kind", "image"), "node": p.node}
            # a final epoch: handed over (every rank's images are in staging, their persisters outlive the job)
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.committer(epoch, records, reason, final=True) if final else
                self.committer(epoch, records, reason))
        except EpochFailed as e:
            log.log(logging.INFO if e.error_kind == "retryable" else logging.ERROR, "epoch %d aborted: %s", epoch, e)
            result.update(status="aborted", rank=e.rank, node=e.node, stage=e.stage, error=e.error,
                          error_kind=e.error_kind)
            self._note_abort(result, await self._abort(parts, epoch, timeouts.abort_after(phase)))
        except Exception as e:  # committer failure
            log.exception("epoch %d commit failed", epoch)
            result.update(status="aborted", stage="commit", error=f"the commit failed: {e}")
            self._note_abort(result, await self._abort(parts, epoch, timeouts.abort_after(phase)))
        else:
            result["commit_s"] = time.monotonic() - t0
            if final:
                self.finished = True
                try:
                    await self._phase(parts, "finish", "done", epoch, 60)
                except EpochFailed as e:
                    log.warning("epoch %d committed but finish did not complete: %s", epoch, e)
            result.update(status="committed", total_s=time.monotonic() - t0,
                          bytes=sum(int(r.get("bytes", 0)) for r in (sealed or captured)),
                          **({"persisting": True} if final else {}))
        self.history.append(result)
        return result

    async def _size(self, parts: list[RankConn], epoch: int, final: bool, reason: str,
                    triggered: float) -> list[RankSize]:
        """Every rank's sizes, when any rank has GPUs (their copies and times are what SIZE is for) or the
        epoch is final (each rank judges, before anything is locked or frozen, whether its capture fits in
        what is left of Slurm's window: `trigger_age_s` of it is gone); a periodic epoch of a job without GPUs
        skips the round trip (the floors hold; the store checks its own space in PREPARE)."""
        if not final and not any(p.gpus for p in parts):
            return []
        age = {"trigger_age_s": round(time.monotonic() - triggered, 2)} if final else {}
        sized = await self._phase(parts, "size", "sized", epoch, self.prepare_timeout_s, final=final,
                                  trigger=reason, **age)
        return [RankSize.from_reply(p.name, p.node, reply) for p, reply in zip(parts, sized)]

    def _send(self, parts: list[RankConn], command: str, reply: str, epoch: int, collect: bool = False,
              **fields: object) -> PhaseReplies:
        barrier = PhaseReplies(len(parts), collect)
        for index, p in enumerate(parts):       # armed before any reply can come
            p.expect(epoch, reply, command, barrier, index)
        prefix = encode_prefix({"type": command, "epoch": epoch, **fields})   # one JSON encoding for all
        for p in parts:
            p.send_prefix(prefix)
        return barrier

    @staticmethod
    def _disarm(parts: list[RankConn], barrier: PhaseReplies) -> None:
        for p in parts:
            if p.waiting and p.waiting.barrier is barrier:
                p.waiting = None

    async def _phase(self, parts: list[RankConn], command: str, reply: str, epoch: int,
                     timeout: float, **fields: Any) -> list[dict[str, Any]]:
        """Every rank's reply, or EpochFailed: the first rank that failed or left, or (timeout) every rank
        that had not answered, by name and node."""
        for p in parts:     # a rank that left between two phases fails this one now, not at its timeout
            if self.ranks.get(p.name) is not p:
                raise EpochFailed(p.name, command, "rank disconnected", p.node)
        barrier = self._send(parts, command, reply, epoch, **fields)
        try:
            return await asyncio.wait_for(barrier.future, timeout)
        except asyncio.TimeoutError:
            silent = barrier.silent(parts)
            raise EpochFailed(silent[0].name, command, f"no answer to {command} within {timeout:.1f}s from "
                              f"{rank_list(silent)} ({len(parts) - len(silent)} of {len(parts)} rank(s) answered)",
                              silent[0].node) from None
        finally:
            self._disarm(parts, barrier)

    async def _abort(self, parts: list[RankConn], epoch: int, timeout: float) -> list[str]:
        """Every rank undoes its part of the epoch (thaw, GPU restore and unlock). Returns, for each rank that
        did not confirm, who it is and why: disconnected, failed to undo, or silent within `timeout`."""
        live = [p for p in parts if self.ranks.get(p.name) is p]
        problems = [f"rank {p.name} (node {p.node}) is disconnected (its agent's watchdog thaws a tree left "
                    "frozen)" for p in parts if p not in live]
        barrier = self._send(live, "abort", "done", epoch, collect=True)
        try:
            await asyncio.wait_for(asyncio.shield(barrier.future), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._disarm(live, barrier)
        for p, answer in zip(live, barrier.replies):
            if answer is None:
                problems.append(f"rank {p.name} (node {p.node}) did not confirm within {timeout:.1f}s (still busy "
                                "with the phase, or stuck; its agent's watchdog thaws a tree frozen too long)")
            elif isinstance(answer, EpochFailed):
                problems.append(f"rank {p.name} (node {p.node}) could not undo its part: {answer.error}")
        if problems:
            log.warning("abort of epoch %d incomplete: %s", epoch, "; ".join(problems))
        return problems

    @staticmethod
    def _note_abort(result: dict[str, Any], problems: list[str]) -> None:
        if problems:
            result["abort"] = "; ".join(problems)

    def missing_ranks(self) -> list[str]:
        present = set(self.ranks) | set(self.completed)
        missing = []
        for step, n in sorted(self.expected.items()):
            have = {name for name in present if validate.rank_name(name).step == step}
            if len(have) < n:
                missing += [str(RankName(step, r)) for r in range(n) if str(RankName(step, r)) not in have
                            ][: n - len(have)]
        return missing
