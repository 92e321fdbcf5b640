"""The NVIDIA driver's release on this node, and what depends on it: the driver's job-wide checkpoint of legacy
CUDA IPC. Read from sysfs (world-readable), so neither side loads libcuda or NVML for it: the user-side wrapper
decides how a GPU task starts (task/defaults.py, cuda/nccl.py), the root side what its check lets through
(cuda/ipc_peers.py) and in which order its GPU stage goes (cuda/stage.py).
"""
from __future__ import annotations

RELEASE_FILE = "/sys/module/nvidia/version"     # the kernel module's release, e.g. 580.159.04
# The first driver release whose checkpoint API checkpoints legacy CUDA IPC (cuIpcGetMemHandle /
# cuIpcOpenMemHandle) between the processes of one cuda-checkpoint job: processes started under
# `cuda-checkpoint --launch-job` (JOB_FILE_VAR in their environment), locked all before any is checkpointed,
# then checkpointed, restored and unlocked one after another in one order (docs/gpu.md, "CUDA IPC"). Not yet
# run here: the GPU machine has 580.
IPC_JOB_RELEASE = 610
JOB_FILE_VAR = "CUDA_CHECKPOINT_JOB_FILE"        # set by `cuda-checkpoint --launch-job` (driver >= 590)


def release(path: str = RELEASE_FILE) -> tuple[int, ...] | None:
    """The NVIDIA kernel module's release as numbers (580.159.04 -> (580, 159, 4)); None without a driver."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    parts = text.split(".")
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def release_text(numbers: tuple[int, ...] | None) -> str:
    return ".".join(f"{n:02d}" if i == 2 else str(n) for i, n in enumerate(numbers)) if numbers else "unknown"


def ipc_jobs(numbers: tuple[int, ...] | None) -> bool:
    """Whether a driver of this release checkpoints CUDA IPC between the members of one cuda-checkpoint job."""
    return numbers is not None and len(numbers) > 0 and numbers[0] >= IPC_JOB_RELEASE
