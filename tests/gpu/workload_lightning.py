#!/usr/bin/env python3
"""PyTorch Lightning as users write it: a LightningModule, a DataLoader, Trainer(accelerator="gpu",
devices=1). Where mpi4py is installed, Lightning's environment detection can start OpenMPI's singleton
daemon beside the program. One line a training step ("step K loss L"), compared with an uninterrupted run."""
from __future__ import annotations

import argparse
import time

import torch

try:
    import lightning.pytorch as pl
except ImportError:                # the older package name
    import pytorch_lightning as pl


class Model(pl.LightningModule):
    def __init__(self, pause: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.pause = pause

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        print(f"step {self.global_step} loss {loss.item():.6f}", flush=True)
        time.sleep(self.pause)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.1)
    a = ap.parse_args()
    pl.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.steps * 16, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=a.steps, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    trainer.fit(Model(a.sleep), loader)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
