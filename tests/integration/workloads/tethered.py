#!/usr/bin/env python3
"""A counter tethered to a process outside its job by a unix stream socket, which CRIU cannot checkpoint one
end of: slurmckpt refuses every capture of it (ipc.py), so a requeued run starts from the beginning.

  --serve PATH      the process outside the job: listens at PATH (then creates PATH.ready), accepts and
                    holds every connection
  --connect PATH    the job's program: connects to PATH (if given), prints "tethered starting at step 0",
                    then "tethered step K" for each step and "tethered PASS steps=N"
"""
from __future__ import annotations

import argparse
import socket
import time


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    open(path + ".ready", "w").close()
    held = []
    while True:
        held.append(listener.accept()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve")
    ap.add_argument("--connect")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sleep", type=float, default=0.5)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    tether = None
    if args.connect:
        tether = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tether.connect(args.connect)
    print("tethered starting at step 0", flush=True)
    for step in range(args.steps):
        print(f"tethered step {step}", flush=True)
        time.sleep(args.sleep)
    print(f"tethered PASS steps={args.steps}", flush=True)
    if tether is not None:
        tether.close()


if __name__ == "__main__":
    main()
