"""Deterministic PyTorch training loop (fixed seeds, deterministic kernels) with a magic value in device memory.

Prints `step <i> loss <float.hex>` per step, so two runs compare bit for bit, then `MAGIC OK|BAD` and `DONE`.
Run with CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (deterministic cuBLAS).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

MAGIC = 0x5EED_C0FF_EE15_600D


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--magic-mib", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(1234)
    torch.cuda.manual_seed_all(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                                torch.nn.GELU(), torch.nn.Linear(2048, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=dev)
    gen.manual_seed(42)
    magic = torch.full((args_mib(a.magic_mib),), MAGIC, dtype=torch.int64, device=dev)
    w = torch.randn(512, 10, device=dev, generator=gen)
    print(f"READY pid={os.getpid()}", flush=True)
    for step in range(a.steps):
        x = torch.randn(1024, 512, device=dev, generator=gen)
        y = (x @ w).argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
    ok = bool((magic == MAGIC).all().item())
    print(f"MAGIC {'OK' if ok else 'BAD'} {magic.numel() * 8} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


def args_mib(mib: int) -> int:
    return mib * (1 << 20) // 8


if __name__ == "__main__":
    sys.exit(main())
