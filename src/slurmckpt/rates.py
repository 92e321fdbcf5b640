"""The rates the GPU copies, criu and the disks ran at, as measured on the H200 (driver 580; docs/gpu.md,
"Rates"), and the margin every timeout built on them keeps. One module below all who estimate with them: the
coordinator's phase timeouts and a final capture's window (coordinator/budget.py), a rank's lease while it
captures (rank/images.py), the agent's own criu and watchdog limits (agent/service.py)."""
from __future__ import annotations

GPU_CHECKPOINT_BPS = 2.0e9          # device -> host, one process (32 GiB: 15-18 s)
GPU_CHECKPOINT_NODE_BPS = 6.0e9     # all processes of a node at once (4 processes on one GPU)
GPU_RESTORE_BPS = 5.5e9             # host -> device, one process
GPU_RESTORE_NODE_BPS = 12.5e9
GPU_CALL_S = 0.5                    # fixed cost of one checkpoint or restore call
CRIU_DUMP_BPS = 1.0e9               # one tree's memory into its images
NODE_WRITE_BPS = 1.6e9              # a node's local disk, direct writes, all ranks at once
SEAL_BPS = 1.6e9                    # images read back and checksummed (xxh3 outruns the disk)
SAFETY = 2.0                        # a timeout is this many times the estimate at the rates above
