"""The coordinator's TCP connections: a challenge, then authenticated lines cut and handled in the event
loop's callbacks; the first message must be the rank's hello; a peer that misbehaves is refused and
lingered out; unauthenticated connections are capped and timed out.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, TYPE_CHECKING, cast

from slurmckpt.coordinator.phase import RankConn
from slurmckpt.coordinator.protocol import LineReader, Sealer, challenge, parse_line
from slurmckpt.errors import ProtocolError

if TYPE_CHECKING:
    from slurmckpt.coordinator.server import Coordinator

log = logging.getLogger("slurmckpt.coordinator")

HELLO_TIMEOUT_S = 5         # a connection that has not authenticated by then is closed
MAX_PENDING = 1024          # unauthenticated connections at once; a new one beyond that evicts the oldest
LINGER_S = 2                # a refused peer gets this long to see our EOF before the socket is closed
READ_SIZE = 256 * 1024



class Connection(asyncio.BufferedProtocol):
    """One TCP connection, driven by the event loop's callbacks: what a read brings is cut into lines,
    authenticated and handled right in buffer_updated. No stream, task or coroutine wake-up per connection
    or per line: at 1000+ ranks those were most of the coordinator's CPU."""

    # set by connection_made, the first call the event loop makes
    transport: asyncio.Transport
    sealer: Sealer
    timer: asyncio.TimerHandle             # the hello's deadline, then the linger's

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.lines = LineReader()
        self.peer: object = None
        self.rank: RankConn | None = None
        self.held: list[bytes] | None = None     # not None while an awaited handler runs: later lines wait
        self.eof = False
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)       # a TCP server's: a full Transport
        self.peer = transport.get_extra_info("peername")
        hello = challenge()
        self.sealer = Sealer(self.coord.token, parse_line(hello)["nonce"])
        self.coord._conns.add(self)
        self.coord._admit(self)
        self.transport.write(hello)
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
        held, self.held = self.held or [], None
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
