#!/usr/bin/env python3
"""A torch.distributed DistributedDataParallel training run as users launch it: one process per Slurm task
(`srun -n N`) or per torchrun worker, rendezvous through init_process_group's env:// (TCPStore on rank 0, or
the store of torchrun's agent), gloo between the ranks, a deterministic model and data. Rank 0 prints one line
per step: the step, the loss and a checksum of the weights, so a run that was captured and restored can be
compared line for line with an uninterrupted one.

  --device cpu|cuda    cuda: each rank on GPU SLURM_LOCALID % device_count (two tasks may share one GPU)
  --workers N          a DataLoader with N workers (default start method: fork)
  --pin-memory         the DataLoader pins its batches in host memory (pin_memory=True), as GPU jobs do
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class Shard(torch.utils.data.Dataset):
    """Samples drawn from a fixed generator per (rank, index): the same data whatever process loads it."""
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.rank * 1_000_003 + i)
        x = torch.randn(64, generator=g)
        return x, x.sum(dim=0, keepdim=True) * 0.1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--sleep", type=float, default=0.25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--pin-memory", action="store_true")
    a = ap.parse_args()
    # torchrun sets RANK, WORLD_SIZE and MASTER_*; a task of `srun -n N` has Slurm's
    # (read lazily: under torchrun in a batch script Slurm sets no SLURM_NTASKS, outside Slurm none of them).
    env = os.environ
    rank = int(env["RANK"]) if "RANK" in env else int(env["SLURM_PROCID"])
    world = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else int(env["SLURM_NTASKS"])
    if "MASTER_PORT" not in env:
        env["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
        env["MASTER_PORT"] = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))) % torch.cuda.device_count())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Shard(rank, a.steps * 8), batch_size=8, num_workers=a.workers,
                                         pin_memory=a.pin_memory)
    if rank == 0:
        print(f"ddp ready world={world} device={device} workers={a.workers}", flush=True)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            weights = sum(float(p.detach().double().sum()) for p in model.parameters())
            print(f"ddp step {step} loss {loss.item():.8f} weights {weights:.8f}", flush=True)
        time.sleep(a.sleep)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("ddp done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
