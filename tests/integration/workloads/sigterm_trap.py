#!/usr/bin/env python3
"""A program with its own SIGTERM handler, like GROMACS, MPI launchers or most services: on SIGTERM it
prints `sigterm_trap caught SIGTERM` and stops early (exit 3), so a SIGTERM that reaches it before the
capture shows in the output and in the result. SIGUSR1 (a signal users send on purpose) is counted and
folded into the state. Prints `sigterm_trap step N` per step and finally `sigterm_trap result R`, R a hash
chain over every step and every SIGUSR1 seen, so a lost or repeated step changes it."""
from __future__ import annotations

import argparse
import hashlib
import signal
import sys
import time

usr1 = 0


def on_term(signum, frame) -> None:
    print("sigterm_trap caught SIGTERM", flush=True)
    sys.exit(3)


def on_usr1(signum, frame) -> None:
    global usr1
    usr1 += 1
    print(f"sigterm_trap got USR1 ({usr1})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sleep", type=float, default=0.2)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)
    state = hashlib.sha256(b"sigterm_trap")
    for i in range(a.steps):
        state.update(str(i).encode())
        print(f"sigterm_trap step {i}", flush=True)
        time.sleep(a.sleep)
    print(f"sigterm_trap result {state.hexdigest()} usr1 {usr1}", flush=True)


if __name__ == "__main__":
    main()
