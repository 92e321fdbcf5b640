#!/usr/bin/env python3
"""torch.compile'd training (TorchInductor): the compiled kernels come from Triton compile workers that
Inductor keeps as a pool of subprocesses beside the program. Deterministic (seeded data, one step a line:
"step K loss L sum S"), compared line for line with an uninterrupted run (tests/gpu/gpu_matrix.sh)."""
from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.1)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).cuda()
    step_fn = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    for k in range(a.steps):
        x = torch.randn(64, 256, device="cuda", generator=g)
        loss = (step_fn(x) - x.mean(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {k} loss {loss.item():.6f} sum {sum(float(p.sum()) for p in model.parameters()):.6f}", flush=True)
        time.sleep(a.sleep)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
