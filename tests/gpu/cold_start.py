"""Cold start of the same state the benchmark's workload holds: import torch, torch.load to the GPU, one tick.
Prints `RUNNING <seconds since process start>` (the comparison point for restore-to-running)."""
from __future__ import annotations

import sys
import time

t0 = time.monotonic()
import torch  # noqa: E402

state = torch.load(sys.argv[1], map_location="cuda")
state["counter"] += 1
print(f"RUNNING hb={int(state['counter'].item())} bytes={state['x'].numel()} {time.monotonic() - t0:.3f}",
      flush=True)
