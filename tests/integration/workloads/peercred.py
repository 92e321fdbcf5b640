#!/usr/bin/env python3
"""Holds the unix sockets whose identity the kernel takes from whoever made them (SO_PEERCRED, the socket
inode's owner), so a test can check what a restored process holds.

In its working directory: `listen.sock`, a listening stream socket open to every user (mode 0777), whose
connections are accepted and closed at every step; `backlog.sock`, a listener with one connection to it made
and left in its backlog (not accepted: at a restore criu makes it again with connect()); a socketpair. Every step prints "peercred step K". When the file `report` appears it prints, for each socket,
the uid/gid the kernel shows its peer and the socket inode's owner:
  peercred backlog-server uid=U gid=G      (accepted now: the connecting side, as the kernel recorded it)
  peercred backlog-client uid=U gid=G      (the listener, as the connecting side sees it)
  peercred socketpair uid=U gid=G
  peercred socket-owner uid=U
then removes `report`."""
from __future__ import annotations

import os
import socket
import struct
import time


def cred(s: socket.socket) -> tuple[int, int]:
    _pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid, gid


def main() -> int:
    for name in ("listen.sock", "backlog.sock"):
        if os.path.exists(name):
            os.unlink(name)
    public = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    public.bind("listen.sock")
    os.chmod("listen.sock", 0o777)
    public.listen(64)
    public.setblocking(False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("backlog.sock")
    listener.listen(4)
    pending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pending.connect("backlog.sock")         # sits in the backlog
    a, _b = socket.socketpair()
    step = 0
    while True:
        step += 1
        print(f"peercred step {step}", flush=True)
        try:
            while True:                     # another user's probe: criu cannot dump a closed one in the backlog
                public.accept()[0].close()
        except BlockingIOError:
            pass
        if os.path.exists("report"):
            conn, _ = listener.accept()
            rows = [("backlog-server", cred(conn)), ("backlog-client", cred(pending)), ("socketpair", cred(a))]
            for name, (uid, gid) in rows:
                print(f"peercred {name} uid={uid} gid={gid}", flush=True)
            print(f"peercred socket-owner uid={os.fstat(a.fileno()).st_uid}", flush=True)
            os.unlink("report")
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
