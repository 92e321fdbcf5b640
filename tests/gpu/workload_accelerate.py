"""A training loop as Hugging Face Accelerate users write it, for `accelerate launch`: Accelerator(), the model,
optimizer and a DataLoader (2 workers, fork, pin_memory) through accelerator.prepare, accelerator.backward.
Fixed seeds and deterministic kernels (run with CUBLAS_WORKSPACE_CONFIG=:4096:8): the main process prints
`step <i> loss <float.hex>` per step, so two runs compare bit for bit, then `DONE`.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    set_seed(1234)
    torch.use_deterministic_algorithms(True)
    accelerator = Accelerator()
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(4096, 256, generator=gen)
    y = (x @ torch.randn(256, 10, generator=gen)).argmax(dim=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256, shuffle=True,
                                       num_workers=2, pin_memory=True, generator=torch.Generator().manual_seed(7),
                                       persistent_workers=True)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, data = accelerator.prepare(model, opt, data)
    step = 0
    while step < a.steps:
        for xb, yb in data:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            if accelerator.is_main_process:
                print(f"step {step} loss {loss.item().hex()}", flush=True)
            step += 1
            if a.sleep:
                time.sleep(a.sleep)
            if step >= a.steps:
                break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
