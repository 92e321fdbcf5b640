#!/usr/bin/env python3
"""An inference-worker-like server: listens on a TCP port of its node (any address), serves any number of
clients, each naming a session (`SESSION id`) and then asking `INCR seq` to get the session's next count
(a repeated seq, resent after a lost reply, gets the same count again). The sessions live only in this
process's memory (with --device cuda: on the GPU, as an inference server keeps each session's KV cache there),
so a client that reconnects after a restore gets the next count only if the worker's state survived. Prints its port to --port-file and one deterministic line per step,
then `worker PASS steps=N`."""
from __future__ import annotations

import argparse
import os
import socket
import threading
import time

sessions: dict[str, tuple[int, int]] = {}      # session -> (last seq, count)
lock = threading.Lock()
device = None                                   # --device cuda: a session's state is a tensor on the GPU
caches: dict = {}                               # session -> GPU tensor, one row per counted request


def count_on_device(session: str) -> int:
    """Count the request in the session's GPU tensor (a KV cache grows by one row a token)."""
    import torch
    row = torch.full((1, 64), float(len(caches.get(session, ())) + 1), device=device)
    caches[session] = row if session not in caches else torch.cat([caches[session], row])
    return int(caches[session].shape[0])


def serve(conn: socket.socket) -> None:
    session = None
    with conn, conn.makefile("rw") as f:
        try:
            for line in f:
                words = line.split()
                if words[:1] == ["SESSION"] and len(words) == 2:
                    session = words[1]
                    continue
                if len(words) == 2 and words[0] == "INCR" and words[1].isdigit() and session:
                    with lock:
                        last, count = sessions.get(session, (-1, 0))
                        if int(words[1]) != last:
                            count = count_on_device(session) if device else count + 1
                        sessions[session] = (int(words[1]), count)
                    f.write(f"{session} {count}\n")
                    f.flush()
        except OSError:
            pass      # the client went away, or the connection came back closed after a restore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    global device
    if a.device != "cpu":
        import torch
        device = torch.device(a.device)
        torch.zeros(1, device=device)        # the GPU context exists before the first client
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(16)
    threading.Thread(target=lambda: [threading.Thread(target=serve, args=(listener.accept()[0],),
                                                      daemon=True).start() for _ in iter(int, 1)],
                     daemon=True).start()
    with open(a.port_file + ".tmp", "w") as f:
        f.write(str(listener.getsockname()[1]))
    os.rename(a.port_file + ".tmp", a.port_file)
    for i in range(a.steps):
        print(f"worker step {i}", flush=True)
        time.sleep(a.sleep)
    print(f"worker PASS steps={a.steps}", flush=True)


if __name__ == "__main__":
    main()
