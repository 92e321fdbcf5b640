#!/usr/bin/env python3
"""Holds files by names that are gone, the three ways criu meets them, and prints what they hold each step.

  --sem NAME    a POSIX named semaphore (glibc's sem_open: /dev/shm/sem.NAME, mapped by a temporary name glibc
                removed once the real name was linked): criu dumps it only with --link-remap
  --relink DIR  DIR/a/f and DIR/keep, two names of one file; DIR/a/f is opened and that name removed: a file
                held by a removed name while another name remains, outside /dev/shm
  --ghost PATH  PATH made, opened and removed (no name left): criu copies it into the images ("ghost file")

Step K posts the semaphore once and writes K into the ghost file, then prints
"relinkhold step K sem=<value> ghost=<what the ghost file holds> relink=<what DIR/a/f holds>", so a restored
run that lost any of the three prints other lines than an uninterrupted run. With --ready FILE it creates
FILE (as a marker) once everything is held.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

O_CREAT = 0o100


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    libc.sem_post.argtypes = [ctypes.c_void_p]
    libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return libc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sem")
    p.add_argument("--relink", action="append", default=[])
    p.add_argument("--ghost")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sleep", type=float, default=0.2)
    p.add_argument("--ready")
    a = p.parse_args()
    libc = _libc()
    sem = None
    if a.sem:
        sem = libc.sem_open(f"/{a.sem}".encode(), O_CREAT, 0o600, 0)
        if not sem or sem == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "sem_open failed", a.sem)
    relinked = []
    for d in a.relink:
        os.makedirs(os.path.join(d, "a"), exist_ok=True)
        path = os.path.join(d, "a", "f")
        with open(path, "w") as f:
            f.write(f"relinked {os.path.basename(d)}")
        os.link(path, os.path.join(d, "keep"))
        relinked.append(os.open(path, os.O_RDONLY))
        os.unlink(path)
    ghost = -1
    if a.ghost:
        ghost = os.open(a.ghost, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(a.ghost)
    if a.ready:
        open(a.ready, "w").close()
    for k in range(a.steps):
        value = ctypes.c_int(-1)
        if sem:
            libc.sem_post(sem)
            libc.sem_getvalue(sem, ctypes.byref(value))
        if ghost >= 0:
            os.pwrite(ghost, f"{k:08d}".encode(), 0)
        held = os.pread(ghost, 8, 0).decode() if ghost >= 0 else "-"
        texts = ",".join(os.pread(fd, 64, 0).decode() for fd in relinked) or "-"
        print(f"relinkhold step {k} sem={value.value} ghost={held} relink={texts}", flush=True)
        time.sleep(a.sleep)
    print("relinkhold done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
