#!/usr/bin/env python3
"""What NCCL's checkpoint-safe transports cost on one node, as far as one GPU can show it (docs/gpu.md, NCCL).

slurmckpt sets NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 for checkpointed GPU jobs, so two
ranks on one node talk through NCCL's network transport: without GPUDirect RDMA that is device -> pinned host
memory -> a TCP socket -> pinned host memory -> device, in chunks. NCCL itself refuses two ranks on one GPU
("Duplicate GPU detected"), so on a one-GPU machine the collective cannot be run; this measures the path it
would take, between two processes on the GPU, beside the copy it replaces:

  device   one on-device copy of the buffer (HBM to HBM). The peer path it stands for (NVLink, PCIe P2P) is
           slower than this; NVLink's own figure is the spec's, printed beside it, not measured here.
  socket   the fallback path: chunks copied device -> pinned host, sent over loopback TCP to a second
           process, received into pinned host memory and copied to its device buffer; timed to its ack.
  loopback the same bytes over the same socket, host to host: the floor of the fallback path.

Paired: each round runs device, socket, loopback back to back (--rounds). Prints each timing and a summary with
min/median/max and the ratios per round. Run on the GPU machine with the image's python3 (torch).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

NVLINK4_ONE_WAY_GBS = 450.0   # H100 SXM spec: 900 GB/s both ways over 18 links (not measured here)


def recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed mid-transfer")
        got += n


def receiver(nbytes: int, chunk: int, port_pipe: Any) -> None:
    import torch    # here and below, not at the top: --help (CI's check that the script starts) needs no torch
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview(p.numpy()) for p in pinned]
    stream = torch.cuda.Stream()
    done = [torch.cuda.Event() for _ in range(2)]
    srv = socket.create_server(("127.0.0.1", 0))
    port_pipe.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = bytearray(1)
    while True:
        recv_exact(conn, memoryview(mode))
        if mode == b"q":
            return
        for i, off in enumerate(range(0, nbytes, chunk)):
            k = i % 2
            done[k].synchronize()                 # the H2D that last used this buffer is finished
            n = min(chunk, nbytes - off)
            recv_exact(conn, views[k][:n])
            if mode == b"g":
                with torch.cuda.stream(stream):
                    dst[off:off + n].copy_(pinned[k][:n], non_blocking=True)
                    done[k].record(stream)
        stream.synchronize()
        conn.sendall(b"k")


def timed_send(conn: socket.socket, mode: bytes, src: Any, pinned: Any, chunk: int) -> float:
    import torch
    nbytes, view = src.numel(), memoryview(pinned.numpy())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    conn.sendall(mode)
    for off in range(0, nbytes, chunk):
        n = min(chunk, nbytes - off)
        if mode == b"g":
            pinned[:n].copy_(src[off:off + n])    # synchronous: the bytes are on the host before the send
        conn.sendall(view[:n])
    recv_exact(conn, memoryview(bytearray(1)))
    return time.perf_counter() - t0


def device_copy(src: Any, dst: Any) -> float:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def summary(name: str, values: list[float]) -> str:
    return (f"{name:<28} min {min(values):8.4g}  median {statistics.median(values):8.4g}  "
            f"max {max(values):8.4g}  (n={len(values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="bytes per transfer, MiB")
    ap.add_argument("--chunk-mib", type=int, default=4, help="chunk size, MiB (NCCL's socket buffers are MiBs)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch
    nbytes, chunk = args.mib << 20, args.chunk_mib << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=receiver, args=(nbytes, chunk, child), daemon=True)
    peer.start()
    conn = socket.create_connection(("127.0.0.1", parent.recv()))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.mib} MiB per transfer, "
          f"{args.chunk_mib} MiB chunks, {args.rounds} rounds (device, socket, loopback each round)")
    device_copy(src, dst), timed_send(conn, b"g", src, pinned, chunk)      # warm-up, not counted
    rates: dict[str, list[float]] = {"device": [], "socket": [], "loopback": []}
    for r in range(args.rounds):
        times = {"device": device_copy(src, dst), "socket": timed_send(conn, b"g", src, pinned, chunk),
                 "loopback": timed_send(conn, b"h", src, pinned, chunk)}
        for name, t in times.items():
            rates[name].append(nbytes / t / 1e9)
        print(f"round {r}: " + "  ".join(f"{n} {nbytes / t / 1e9:7.2f} GB/s" for n, t in times.items()))
    conn.sendall(b"q")
    peer.join(10)
    print(summary("device copy GB/s", rates["device"]))
    print(summary("socket path GB/s", rates["socket"]))
    print(summary("loopback floor GB/s", rates["loopback"]))
    per_round = [s / d for s, d in zip(rates["socket"], rates["device"])]
    print(summary("socket / device copy", per_round))
    print(summary("socket / loopback", [s / h for s, h in zip(rates["socket"], rates["loopback"])]))
    nv = [s / NVLINK4_ONE_WAY_GBS for s in rates["socket"]]
    print(summary(f"socket / NVLink4 {NVLINK4_ONE_WAY_GBS:.0f} (spec)", nv))


if __name__ == "__main__":
    main()
