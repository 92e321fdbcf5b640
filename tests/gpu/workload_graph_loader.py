"""Deterministic PyTorch training whose step runs as a captured CUDA graph (forward, backward and a
capturable Adam step replayed from static buffers), fed by a DataLoader worker pool (persistent worker
processes: the tree has several processes, only the trainer holds CUDA state).

Each sample comes from a generator seeded by its index, so the data do not depend on which worker made
them. Prints `step <i> loss <float.hex>` per step, then `MAGIC OK|BAD` and `DONE`. Run with
CUBLAS_WORKSPACE_CONFIG=:4096:8.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

MAGIC = 0x5EED_C0FF_EE15_600D


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.target = torch.randn(256, 10, generator=torch.Generator().manual_seed(42))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(256, generator=torch.Generator().manual_seed(1000 + i))
        return x, (x @ self.target).argmax()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--magic-mib", type=int, default=256)
    ap.add_argument("--mp", default=None, help="the workers' start method (default: fork, PyTorch's)")
    a = ap.parse_args()
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")
    batch = 512
    loader = DataLoader(Samples(a.steps * batch), batch_size=batch, num_workers=a.workers,
                        persistent_workers=a.workers > 0, prefetch_factor=2 if a.workers else None,
                        multiprocessing_context=a.mp if a.workers else None)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    static_x = torch.zeros(batch, 256, device=dev)
    static_y = torch.zeros(batch, dtype=torch.long, device=dev)
    magic = torch.full((a.magic_mib << 17,), MAGIC, dtype=torch.int64, device=dev)

    side = torch.cuda.Stream()       # warm-up on a side stream, as CUDA graph capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    # undo the warm-up in place (the graph keeps these very buffers): seeded weights, empty optimizer state
    torch.manual_seed(1234)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10))
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)
        for state in opt.state.values():
            for t in state.values():
                t.zero_()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = torch.nn.functional.cross_entropy(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    print(f"READY pid={os.getpid()} workers={a.workers} graph captured", flush=True)
    for step, (x, y) in enumerate(loader):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        print(f"step {step} loss {static_loss.item().hex()}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
    ok = bool((magic == MAGIC).all().item())
    print(f"MAGIC {'OK' if ok else 'BAD'} {magic.numel() * 8} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
