"""The job's coordinator in a process of its own, started and supervised by the wrapper that hosts it.

Why a process: the coordinator must be able to die (a bug, kill -9, the OOM killer) without taking the job
with it. Its wrapper notices, starts a new one and re-publishes the address; ranks reconnect and epochs go
on, never reusing an epoch number (each rank names its last epoch in its hello). Only the wrapper's root
agent can commit, so commits travel back over the link: a private socketpair carrying JSON lines.

    wrapper -> host: {"op": "start", settings...}  {"op": "epoch", "reason", "final"}  {"op": "committed", "id"}
                     {"op": "allocated", "id", "epoch" | "error"}  {"op": "interruptions", "id", "answer" | "error"}
    host -> wrapper: {"op": "listening", "port"}  {"op": "commit", "id", "epoch", "ranks", "reason", "final"}
                     {"op": "allocate", "id", "at_least", "final"}  {"op": "interruptions", "id"}
                     {"op": "started", "rank", "action"}  {"op": "result", "result", "reason", "final"}
                     {"op": "interval", "choice", "line", "changed"}

Periodic epochs are started here (the interval timer: the shortest interval any rank asked for, counted
from the end of the last epoch); the wrapper asks for the others (Slurm's SIGTERM, wall-time, manual). A rank
that asked for --checkpoint-interval=auto counts with the interval chosen here (coordinator/interval.py),
from the stall of each committed periodic epoch and the interruption rate the hosting task's root agent
reads from accounting; every new choice goes to the wrapper, which says it and has its agent record it.

    python -m slurmckpt.coordinator.host --link FD --job JOBID     (started by slurmckpt.coordinator.supervisor)
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import resource
import signal
import socket
from typing import Any

from slurmckpt.coordinator.interval import AutoInterval, AutoSettings, IntervalClock
from slurmckpt.coordinator.connection import MAX_PENDING
from slurmckpt.coordinator.server import Coordinator
from slurmckpt.duration import AUTO

log = logging.getLogger("slurmckpt.coordinator.host")

LINK_LIMIT = 16 * 1024 * 1024      # a commit names every rank of the job


class Host:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.coordinator: Coordinator | None = None
        self.commits: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count(1)
        self.loop = asyncio.get_running_loop()
        self.interval = IntervalClock()
        self.running = 0                   # epochs in flight (their own kinds are merged by the coordinator)
        self.auto: AutoInterval | None = None      # the plan's auto settings: a rank may ask for auto
        self.auto_used = False                     # a rank asked for auto: its choices are announced

    def send(self, message: dict[str, Any]) -> None:
        if self.writer.is_closing():      # the wrapper is gone (its step ended): nobody is left to tell
            return
        self.writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def _next_line(self) -> bytes:
        """The wrapper's next line; b"" once it is gone, whether its end was read first or a write to it
        failed first (an epoch's word on its way as the job's step ended: the reader then holds the
        write's EPIPE, which must not reach the job's output as a traceback)."""
        try:
            return await self.reader.readline()
        except ConnectionError:
            return b""

    async def run(self) -> None:
        start = json.loads(await self.reader.readline())
        self.coordinator = Coordinator(
            start["token"], self._commit, int(start["next_epoch"]), dict(start.get("completed", {})),
            float(start["prepare_timeout_s"]), float(start["capture_timeout_s"]),
            on_started=self._started, on_trigger=self.epoch, lock_rounds=int(start.get("lock_rounds", 8)),
            max_pending=max_pending(), allocate=self._allocate,
            persist_timeout_s=float(start.get("persist_timeout_s", 1800.0)))
        settings = AutoSettings.from_plan(start)
        self.auto = AutoInterval(settings) if settings else None
        # the job's own address only (loopback for a one-node job): never every interface of the node
        port = await self.coordinator.start(str(start.get("bind", "127.0.0.1")))
        self.send({"op": "listening", "port": port})
        watcher = asyncio.ensure_future(self._interval_timer())
        try:
            while line := await self._next_line():
                msg = json.loads(line)
                if msg["op"] == "epoch":
                    self.epoch(str(msg["reason"]), bool(msg["final"]))
                elif msg["op"] in ("committed", "allocated", "interruptions"):
                    future = self.commits.pop(int(msg["id"]), None)
                    if future and not future.done():
                        future.set_result(msg)
        finally:                   # the wrapper is gone: so is the job's step; nothing to coordinate
            watcher.cancel()
            await self.coordinator.stop()

    def epoch(self, reason: str, final: bool) -> None:
        async def run() -> None:
            assert self.coordinator
            self.running += 1
            try:
                result = await self.coordinator.run_epoch(reason, final)
            finally:
                self.running -= 1
                self.interval.epoch_ended()
            self.send({"op": "result", "result": result, "reason": reason, "final": final})
            if self.auto_used and self.auto and result.get("status") == "committed" and not final:
                self._announce(self.auto.observe(result))
                asyncio.ensure_future(self._interruptions())
        asyncio.ensure_future(run())

    def _announce(self, changed: bool) -> None:
        """The current choice and its inputs, to the wrapper (which says it when it `changed` and has its
        agent record it for `slurmckpt status`)."""
        assert self.auto
        choice = self.auto.current
        self.send({"op": "interval", "choice": choice.as_dict(), "line": choice.describe(), "changed": changed})

    async def _interruptions(self) -> None:
        """The root agent's word on the partition's interruptions (answered from its node's cache at once;
        a stale cache is refreshed in the background and the fresh answer comes with a later commit)."""
        try:
            reply = await self.loop.run_in_executor(None, self._ask, {"op": "interruptions"})
        except Exception as e:  # noqa: BLE001 - the site's value stands
            log.warning("no interruption rate from the agent: %s", e)
            return
        assert self.auto
        answer = reply.get("answer")
        if isinstance(answer, dict):
            changed = self.auto.heard(answer)
            self._announce(changed)

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Runs in an executor thread (the coordinator's contract): a round trip to the wrapper's agent."""
        async def ask() -> dict[str, Any]:
            ident = next(self.ids)
            future = self.loop.create_future()
            self.commits[ident] = future
            self.send({**message, "id": ident})
            answer: dict[str, Any] = await future
            return answer
        reply = asyncio.run_coroutine_threadsafe(ask(), self.loop).result()
        if reply.get("error"):
            raise RuntimeError(reply["error"])
        return reply

    def _commit(self, epoch: int, ranks: dict[str, Any], reason: str, final: bool = False) -> None:
        self._ask({"op": "commit", "epoch": epoch, "ranks": ranks, "reason": reason, "final": final})

    def _allocate(self, at_least: int, final: bool = False) -> int:
        return int(self._ask({"op": "allocate", "at_least": at_least, "final": final})["epoch"])

    async def _started(self, rank: str, action: str) -> None:
        self.send({"op": "started", "rank": rank, "action": action})

    def interval_s(self) -> int:
        """The shortest interval any rank asked for; auto counts as the interval chosen now."""
        assert self.coordinator
        asked = {r.interval for r in self.coordinator.ranks.values()}
        fixed = [i for i in asked if i > 0]
        if AUTO in asked and self.auto:
            if not self.auto_used:          # the first rank that asks for auto: the first choice is said
                self.auto_used = True
                self._announce(True)
                asyncio.ensure_future(self._interruptions())
            fixed.append(self.auto.current.interval_s)
        return min(fixed, default=0)

    async def _interval_timer(self) -> None:
        """Periodic epochs: the shortest interval any rank asked for (ranks join and leave, so it is read
        again every round), never while another epoch is in flight."""
        while True:
            wait = self.interval.seconds_to_next(self.interval_s())
            await asyncio.sleep(1.0 if wait is None else min(1.0, max(0.05, wait)))
            if not self.running and self.interval.due(self.interval_s()):
                self.epoch("interval", False)


def max_pending() -> int:
    """Unauthenticated connections may hold a quarter of our fds at most: ranks must still get in."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_PENDING if soft == resource.RLIM_INFINITY else max(16, min(MAX_PENDING, soft // 4))


async def serve(link_fd: int) -> None:
    sock = socket.socket(fileno=link_fd)
    reader, writer = await asyncio.open_connection(sock=sock, limit=LINK_LIMIT)
    await Host(reader, writer).run()


def main() -> None:
    parser = argparse.ArgumentParser(prog="slurmckpt-coordinator")
    parser.add_argument("--link", type=int, required=True, help="socketpair fd to the hosting wrapper")
    parser.add_argument("--job", required=True, help="job id (for ps and logs only)")
    args = parser.parse_args()
    # Slurm signals every process of the step at preemption/time limit; that SIGTERM is the wrapper's to turn
    # into a final capture, which this process must outlive to coordinate.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    # Room for every rank's connection plus the capped unauthenticated ones (server.MAX_PENDING)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    logging.basicConfig(level=logging.WARNING, format=f"slurmckpt coordinator job {args.job}: %(message)s")
    asyncio.run(serve(args.link))


if __name__ == "__main__":
    main()
