#!/usr/bin/env python3
"""A Python multiprocessing pool doing numpy work: --workers processes (--start fork, spawn or forkserver;
pipes and POSIX semaphores between them: with spawn and forkserver the semaphores are named files in
/dev/shm) compute per-chunk matrix products round after round; the parent folds every
result into a running checksum. Prints `mp_numpy round N` per round and `mp_numpy result R` at the end: a
lost, repeated or reordered round, or a worker restored with the wrong state, changes R."""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import time

import numpy as np

_state: dict = {}


def _init(seed: int) -> None:
    # Per-worker state that only survives if the worker itself is restored with its memory.
    _state["m"] = np.random.default_rng(seed).standard_normal((64, 64))


def _chunk(args: tuple[int, int]) -> bytes:
    rnd, i = args
    v = np.arange(64, dtype=np.float64) * (rnd + 1) + i
    out = _state["m"] @ v
    return np.round(out, 6).tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--start", choices=("fork", "spawn", "forkserver"), default="fork")
    a = ap.parse_args()
    digest = hashlib.sha256()
    with mp.get_context(a.start).Pool(a.workers, initializer=_init, initargs=(7,)) as pool:
        for rnd in range(a.rounds):
            for part in pool.map(_chunk, [(rnd, i) for i in range(8)]):
                digest.update(part)
            print(f"mp_numpy round {rnd}", flush=True)
            time.sleep(a.sleep)
    print(f"mp_numpy result {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
