"""Throughput workload for tests/gpu/throughput.py: a deterministic PyTorch training loop (fixed seeds,
deterministic kernels, fp32) that keeps several GiB on the GPU -- an MLP of ~143 M parameters (weights, grads and
AdamW state ~2.3 GB) plus a --magic-mib buffer of a known value -- so that captures copy a realistic amount of
device memory. The loop is workload_train.py's, scaled up, with a wall-clock stamp on every step line:

    step <i> loss <float.hex> t <time.time()>

then `MAGIC OK|BAD ...` and `DONE`. It stops after --steps steps or, with --seconds S, after the first step that
ends S seconds after step 0 started (the loss of step i never depends on either, so a run of --seconds S and a
run of --steps N compare bit for bit over their common steps). --cpu: a torch-free stand-in with the same output
(rehearsal on a machine without a GPU). Run with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

MAGIC = 0x5EED_C0FF_EE15_600D


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: --steps only)")
    ap.add_argument("--magic-mib", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--cpu", action="store_true", help="torch-free stand-in (rehearsal)")
    a = ap.parse_args()
    return (cpu_loop if a.cpu else gpu_loop)(a)


def gpu_loop(a) -> int:
    import torch
    torch.manual_seed(1234)
    torch.cuda.manual_seed_all(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    h = a.hidden
    model = torch.nn.Sequential(torch.nn.Linear(1024, h), torch.nn.GELU(), torch.nn.Linear(h, h), torch.nn.GELU(),
                                torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=dev)
    gen.manual_seed(42)
    magic = torch.full((a.magic_mib * (1 << 20) // 8,), MAGIC, dtype=torch.int64, device=dev)
    w = torch.randn(1024, 10, device=dev, generator=gen)
    params = sum(p.numel() for p in model.parameters())
    print(f"READY pid={os.getpid()} params={params} torch={torch.__version__} "
          f"device={torch.cuda.get_device_name(0)}", flush=True)
    t0 = time.time()
    for step in range(a.steps):
        x = torch.randn(a.batch, 1024, device=dev, generator=gen)
        y = (x @ w).argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        now = time.time()
        print(f"step {step} loss {value.hex()} t {now:.6f}", flush=True)
        if step == 0:
            print(f"MEM allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB reserved "
                  f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB", flush=True)
        if a.seconds and now - t0 >= a.seconds:
            break
    ok = bool((magic == MAGIC).all().item())
    print(f"MAGIC {'OK' if ok else 'BAD'} {magic.numel() * 8} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


def cpu_loop(a) -> int:
    word = MAGIC.to_bytes(8, "little")
    magic = bytearray(word * (a.magic_mib * (1 << 20) // 8))
    state, loss = 1234, 2.0
    print(f"READY pid={os.getpid()} cpu stand-in", flush=True)
    t0 = time.time()
    for step in range(a.steps):
        for _ in range(2000):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        loss = loss * 0.99 + (state >> 11) / float(1 << 53) * 1e-3
        time.sleep(0.01)
        now = time.time()
        print(f"step {step} loss {loss.hex()} t {now:.6f}", flush=True)
        if a.seconds and now - t0 >= a.seconds:
            break
    ok = magic == word * (len(magic) // 8)
    print(f"MAGIC {'OK' if ok else 'BAD'} {len(magic)} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
