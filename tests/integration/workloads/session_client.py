#!/usr/bin/env python3
"""A client of session_worker.py that stays with its worker across a requeue: it asks for --count INCRs of
one session (numbered, so one resent after a lost reply is not counted twice), one every --sleep seconds; when the connection ends (reset, EOF), it reconnects (for up to
--patience seconds) and goes on with the same session. Every reply must be the previous count + 1 (the
worker's in-memory session survived). Prints `client reconnected` per reconnect and finally
`client PASS count=N reconnects=R` or `client FAIL ...`."""
from __future__ import annotations

import argparse
import socket
import sys
import time


def connect(host: str, port: int, session: str, patience: float):
    deadline = time.monotonic() + patience
    while True:
        try:
            s = socket.create_connection((host, port), timeout=10)
            f = s.makefile("rw")
            f.write(f"SESSION {session}\n")
            f.flush()
            return s, f
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--session", default="s1")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--patience", type=float, default=300)
    a = ap.parse_args()
    s, f = connect(a.host, a.port, a.session, a.patience)
    print("client connected", flush=True)
    expected, reconnects = 1, 0
    while expected <= a.count:
        try:
            f.write(f"INCR {expected}\n")
            f.flush()
            reply = f.readline()
            if not reply:
                raise ConnectionResetError("EOF")
        except OSError:
            s.close()
            s, f = connect(a.host, a.port, a.session, a.patience)
            reconnects += 1
            print("client reconnected", flush=True)
            continue
        if reply.split() != [a.session, str(expected)]:
            print(f"client FAIL want {a.session} {expected}, got {reply.strip()!r}", flush=True)
            sys.exit(1)
        print(f"client got {expected}", flush=True)
        expected += 1
        time.sleep(a.sleep)
    print(f"client PASS count={a.count} reconnects={reconnects}", flush=True)


if __name__ == "__main__":
    main()
