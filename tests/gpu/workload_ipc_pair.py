"""An actor/learner pair sharing CUDA tensors through torch.multiprocessing (spawn): the learner owns a weight
tensor on the GPU and sends it once through a Queue (CUDA IPC: cudaIpcGetMemHandle in the learner,
cudaIpcOpenMemHandle in the actor); each step the actor reads the shared weights and sends back a number, the
learner updates the weights in place. The GPU matrix's CUDA IPC row (docs/gpu.md, "CUDA IPC"): on driver 580
every capture is refused at the check stage naming both pids and CUDA IPC; from 610 on, started in a
cuda-checkpoint job, it is captured and restored.

Prints `step <i> value <float.hex>` per step (deterministic: two runs compare bit for bit), then `DONE`.

    python3 workload_ipc_pair.py --steps 300 --sleep 0.1
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def actor(weights_q, ask_q, answer_q) -> None:
    import torch
    w = weights_q.get()                       # the learner's CUDA tensor, mapped through CUDA IPC
    print(f"ACTOR pid={os.getpid()} device={w.device}", flush=True)
    while (step := ask_q.get()) is not None:
        x = torch.arange(w.numel(), device=w.device, dtype=w.dtype) / w.numel()
        answer_q.put((step, float((w * x).sum().item())))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    weights_q, ask_q, answer_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    torch.manual_seed(1234)
    w = torch.randn(1 << 20, device="cuda", dtype=torch.float64)
    p = ctx.Process(target=actor, args=(weights_q, ask_q, answer_q))
    p.start()
    weights_q.put(w)
    print(f"LEARNER pid={os.getpid()} actor={p.pid}", flush=True)
    for step in range(a.steps):
        ask_q.put(step)
        got, value = answer_q.get()
        assert got == step
        w.mul_(0.999).add_(value * 1e-9)          # in place: the actor sees it through the same memory
        torch.cuda.synchronize()
        print(f"step {step} value {value.hex()}", flush=True)
        time.sleep(a.sleep)
    ask_q.put(None)
    p.join(30)
    print("DONE", flush=True)
    return 0 if p.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
