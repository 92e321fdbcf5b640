#!/usr/bin/env python3
"""Holds one piece of path-named state that `criu restore` re-opens by path, and prints what it holds on
every step, so a test can swap the path between capture and restore and see what a restored process got.

  --mode rdwr   a regular file open O_RDWR; each step writes "tick" at offset 0 through the fd
  --mode mmap   a regular file mapped MAP_SHARED read-write through libc (Python's mmap would keep a dup of
                the fd), the fd closed; each step writes "tick" through the mapping
  --mode cwd    the process's working directory
  --mode unix   a unix stream socket bound and listening at a path
  --mode inotify an inotify watch for files created in a directory; each step also prints the names
                its events carried ("pathhold event NAME")

Each step prints "pathhold step K holds <path>", the path being what the kernel names for the state now
(/proc/self/fd, /proc/self/maps, getcwd, the socket's bound name). --state names a marker file: when it
exists already, this is a fresh start after a failed restore, which prints "pathhold fresh start" and exits 0.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import struct
import sys
import time


IN_CREATE = 0x100


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _events(fd: int) -> str:
    """The names the pending inotify events carry ("-" when none); each also printed as an event line."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return "watch"
    names, off = [], 0
    while off + 16 <= len(data):
        _wd, _mask, _cookie, size = struct.unpack_from("iIII", data, off)
        names.append(data[off + 16:off + 16 + size].rstrip(b"\0").decode(errors="replace"))
        off += 16 + size
    for name in names:
        print(f"pathhold event {name}", flush=True)
    return "watch"


def held(mode: str, fd: int, mem: int, sock: socket.socket | None) -> str:
    if mode == "inotify":
        return _events(fd)
    if mode == "rdwr":
        os.pwrite(fd, b"tick", 0)
        return os.readlink(f"/proc/self/fd/{fd}")
    if mode == "mmap":
        ctypes.memmove(mem, b"tick", 4)
        with open("/proc/self/maps") as f:
            paths = [l.split(None, 5)[5].strip() for l in f if len(l.split(None, 5)) == 6 and "rw-s" in l]
        return ",".join(paths) or "-"
    if mode == "cwd":
        return os.getcwd()
    return str(sock.getsockname())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["rdwr", "mmap", "cwd", "unix", "inotify"])
    ap.add_argument("--path", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--sleep", type=float, default=0.5)
    a = ap.parse_args()
    if os.path.exists(a.state):
        print("pathhold fresh start", flush=True)
        return 0
    open(a.state, "w").close()
    fd, mem, sock = -1, 0, None
    if a.mode == "rdwr":
        fd = os.open(a.path, os.O_RDWR)
    elif a.mode == "mmap":
        fd = os.open(a.path, os.O_RDWR)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        mem = libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if mem in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        os.close(fd)
    elif a.mode == "cwd":
        os.chdir(a.path)
    elif a.mode == "inotify":
        fd = _libc().inotify_init1(os.O_NONBLOCK)
        if fd < 0 or _libc().inotify_add_watch(fd, os.fsencode(a.path), IN_CREATE) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(a.path)
        sock.listen(4)
    print(f"pathhold ready mode={a.mode}", flush=True)
    for k in range(a.steps):
        print(f"pathhold step {k} holds {held(a.mode, fd, mem, sock)}", flush=True)
        time.sleep(a.sleep)
    print("pathhold done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
