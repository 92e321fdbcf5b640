#!/usr/bin/env python3
"""Two ranks of one `srun -n2` step on one node exchange sequence-numbered messages over one IPC mechanism
(--mech). Each rank sends message k (its deterministic value) up to --window messages ahead of what it has
received, so messages are in flight at any capture, and prints "rR step K got V" for the peer's message k
(checked: sequence number and value), then "rR PASS steps=N". A restored job must print exactly
`expected_lines()`: a lost, repeated or reordered message shows as BAD, a hang or an error.

Mechanisms, and what slurmckpt does with them (each rank is its own tree, dumped and restored on its own):
  tcp      loopback TCP connection               restored exactly (netlock holds it while one end is back)
  shm      a /dev/shm file both map shared       restored exactly while the file holds what it held at the
                                                 capture (final captures on the node); else the restore is
                                                 refused and falls back (crash after a periodic capture)
  ustream  unix stream socket bound to a path    capture refused before anything is frozen
  udgram   unix datagram sockets, sendto(path)   capture refused
  fifo     two named pipes                       capture refused
A refused capture leaves the job running; its output is then exact as well.
"""
from __future__ import annotations

import argparse
import mmap
import os
import random
import socket
import struct
import time

REC = 32


def value(rank: int, k: int) -> int:
    return random.Random(rank * 100003 + k).randint(0, 10**6)


def expected_lines(rank: int, steps: int) -> list[str]:
    peer = 1 - rank
    return [f"r{rank} step {k} got {value(peer, k)}" for k in range(steps)] + [f"r{rank} PASS steps={steps}"]


def record(rank: int, k: int) -> bytes:
    return f"{k} {value(rank, k)}".encode().ljust(REC - 1) + b"\n"


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.02)


# ---- transports: send(bytes of REC) / recv() -> bytes of REC ---------------------------------------------
class Stream:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> bytes:
        while len(self.buf) < REC:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise SystemExit("peer closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:REC], self.buf[REC:]
        return data


def tcp(rank: int, d: str, tag: str) -> Stream:
    port_file = os.path.join(d, f"ipc-{tag}.port")
    if rank == 0:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(ls.getsockname()[1]))
        os.rename(tmp, port_file)
        conn, _ = ls.accept()
        ls.close()
        return Stream(conn)
    wait_for(port_file)
    return Stream(socket.create_connection(("127.0.0.1", int(open(port_file).read()))))


def ustream(rank: int, d: str, tag: str) -> Stream:
    path = os.path.join(d, f"ipc-{tag}.sock")
    if rank == 0:
        ls = socket.socket(socket.AF_UNIX)
        ls.bind(path)
        ls.listen(1)
        open(path + ".ready", "w").close()
        conn, _ = ls.accept()
        return Stream(conn)
    wait_for(path + ".ready")
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return Stream(s)


class Datagrams:
    def __init__(self, rank: int, d: str, tag: str) -> None:
        me, self.peer = (os.path.join(d, f"ipc-{tag}.{r}.dsock") for r in (rank, 1 - rank))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(me)
        wait_for(self.peer)

        self.started = False

    def send(self, data: bytes) -> None:
        while True:
            try:
                self.sock.sendto(data, self.peer)
                self.started = True
                return
            except ConnectionRefusedError:
                if self.started:
                    raise
                time.sleep(0.02)         # the peer's socket file exists a moment before it is bound

    def recv(self) -> bytes:
        return self.sock.recv(REC)


class Fifos:
    def __init__(self, rank: int, d: str, tag: str) -> None:
        out, inp = (os.path.join(d, f"ipc-{tag}.{a}to{b}") for a, b in ((rank, 1 - rank), (1 - rank, rank)))
        for path in (out, inp):
            try:
                os.mkfifo(path)
            except FileExistsError:
                pass
        # opposite order on the two ranks, or both block in open()
        if rank == 0:
            self.w = os.open(out, os.O_WRONLY)
            self.r = os.open(inp, os.O_RDONLY)
        else:
            self.r = os.open(inp, os.O_RDONLY)
            self.w = os.open(out, os.O_WRONLY)

    def send(self, data: bytes) -> None:
        os.write(self.w, data)

    def recv(self) -> bytes:
        data = b""
        while len(data) < REC:
            chunk = os.read(self.r, REC - len(data))
            if not chunk:
                raise SystemExit("fifo closed by the peer")
            data += chunk
        return data


class SharedMemory:
    """Per direction a ring of SLOTS records with a written counter and a read counter. Counters are stored
    with slice assignment: struct.pack_into zeroes the field before writing it, a transient 0 the peer sees."""
    SLOTS, MAGIC = 64, b"IPCPAIR1"
    HEAD = 16            # magic, done flag
    LANE = 16 + SLOTS * REC

    def __init__(self, rank: int, d: str, tag: str) -> None:
        self.path = f"/dev/shm/slurmckpt-ipc-{tag}"
        self.rank = rank
        size = self.HEAD + 2 * self.LANE
        if rank == 0:                    # made under another name: rank 1 never sees it half-initialised
            fd = os.open(self.path + ".new", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
            os.pwrite(fd, self.MAGIC, 0)
            os.rename(self.path + ".new", self.path)
        else:
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    if os.fstat(fd).st_size == size and os.pread(fd, 8, 0) == self.MAGIC:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                time.sleep(0.02)
        self.m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
        self.out, self.inp = self.HEAD + rank * self.LANE, self.HEAD + (1 - rank) * self.LANE
        self.sent = self.received = 0

    def _get(self, off: int) -> int:
        return struct.unpack("Q", self.m[off:off + 8])[0]

    def _set(self, off: int, v: int) -> None:
        self.m[off:off + 8] = struct.pack("Q", v)

    def send(self, data: bytes) -> None:
        while self.sent - self._get(self.out + 8) >= self.SLOTS:       # ring full: peer has not read
            time.sleep(0.001)
        slot = self.out + 16 + (self.sent % self.SLOTS) * REC
        self.m[slot:slot + REC] = data
        self.sent += 1
        self._set(self.out, self.sent)

    def recv(self) -> bytes:
        while self._get(self.inp) <= self.received:
            time.sleep(0.001)
        slot = self.inp + 16 + (self.received % self.SLOTS) * REC
        data = self.m[slot:slot + REC]
        self.received += 1
        self._set(self.inp + 8, self.received)
        return data

    def close(self) -> None:
        """Rank 1 says it is done and unmaps; rank 0 waits for that, then removes the file."""
        if self.rank == 1:
            self._set(8, 1)
            self.m.close()
            return
        while self._get(8) != 1:
            time.sleep(0.01)
        self.m.close()
        os.unlink(self.path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mech", required=True, choices=["tcp", "shm", "ustream", "udgram", "fifo"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--dir", default=".")
    a = ap.parse_args()
    rank, ranks = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    if ranks != 2:
        raise SystemExit("ipc_pair.py needs exactly two ranks (srun -n2)")
    env = os.environ.get
    tag = f"{env('SLURM_JOB_ID', os.getppid())}.{env('SLURM_STEP_ID', '0')}.{env('SLURM_RESTART_COUNT', '0')}"
    link = {"tcp": tcp, "ustream": ustream, "udgram": Datagrams, "fifo": Fifos,
            "shm": SharedMemory}[a.mech](rank, a.dir, tag)
    peer, sent = 1 - rank, 0
    for k in range(a.steps):
        while sent < min(a.steps, k + a.window):
            link.send(record(rank, sent))
            sent += 1
        seq, v = (int(x) for x in link.recv().split())
        ok = seq == k and v == value(peer, k)
        print(f"r{rank} step {k} got {v}" + ("" if ok else f" BAD(seq {seq})"), flush=True)
        time.sleep(a.sleep)
    if isinstance(link, SharedMemory):
        link.close()
    print(f"r{rank} PASS steps={a.steps}", flush=True)


if __name__ == "__main__":
    main()
