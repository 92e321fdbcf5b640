"""What one rank's capture will take, measured in the epoch's SIZE phase before anything is locked or frozen,
and the refusal of a capture that cannot fit (docs/gpu.md, "Large GPU memory").

    host_bytes   the tree's memory CRIU writes: anonymous and shared pages, resident or swapped
    gpu_bytes    device memory of each CUDA process (NVML); the GPU checkpoint copies it into that process's
                 host memory, and CRIU then writes it with the rest
    image_bytes  host_bytes + gpu_bytes: what the rank's images take

The GPU copy must fit in the node's MemAvailable and in the room the tightest memory cgroup above the CUDA
processes leaves (host_memory.py): past either, the OOM killer ends the job inside its capture. The images
must fit in the store's file system. Each refusal names what does not fit and by how much; the coordinator
then checks the sums of ranks that share a node or a cgroup (coordinator/budget.py) and derives the phase
timeouts from the bytes. The sizes reach the coordinator in the `sized` reply (`Footprint.reply`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmckpt.node import procfs
from slurmckpt.node import host_memory
from slurmckpt.store.durable import free_bytes      # the one free-space read (space.py reserves by it too)
from slurmckpt.cuda.interface import GpuStage, GpuUse
from slurmckpt.node.host_memory import Headroom
from slurmckpt.sizes import size_text

MEMORY_FIELDS = ("RssAnon", "RssShmem", "VmSwap")     # /proc/PID/status, kB



@dataclass(frozen=True)
class Footprint:
    host_bytes: int
    gpu: GpuUse
    mem_available: int
    headroom: Headroom | None      # tightest memory cgroup above the CUDA processes; None: no limit
    store_free: int | None         # bytes free where the images go; None: not known

    @property
    def gpu_bytes(self) -> int:
        return self.gpu.bytes

    @property
    def image_bytes(self) -> int:
        return self.host_bytes + self.gpu_bytes

    def refusals(self) -> list[str]:
        """What does not fit, each naming the resource, the need and the shortfall."""
        out, gpu = [], self.gpu_bytes
        procs = f"{len(self.gpu.held)} CUDA process(es)"
        if gpu > self.mem_available:
            out.append(f"the GPU checkpoint copies {size_text(gpu)} of device memory ({procs}) into host memory, but the "
                       f"node has {size_text(self.mem_available)} available (MemAvailable): {size_text(gpu - self.mem_available)} "
                       "short")
        if self.headroom is not None and gpu > self.headroom.bytes:
            out.append(f"the GPU checkpoint copies {size_text(gpu)} of device memory ({procs}) into the job's host memory, "
                       f"but its memory cgroup {self.headroom.cgroup} (limit {size_text(self.headroom.limit)}) has room for "
                       f"{size_text(self.headroom.bytes)}: {size_text(gpu - self.headroom.bytes)} short; ask Slurm for more "
                       "memory (--mem) or hold less GPU memory")
        if self.store_free is not None and self.image_bytes > self.store_free:
            out.append(f"the images take about {size_text(self.image_bytes)} (host {size_text(self.host_bytes)} + GPU {size_text(gpu)}), "
                       f"but the image store has {size_text(self.store_free)} free: "
                       f"{size_text(self.image_bytes - self.store_free)} short")
        return out

    def reply(self) -> dict[str, Any]:
        """The rank's `sized` reply (validated by coordinator/budget.RankSize.from_reply)."""
        largest = max((sum(g.values()) for g in self.gpu.held.values()), default=0)
        out: dict[str, Any] = {"host_bytes": self.host_bytes, "gpu_bytes": self.gpu_bytes, "gpu_processes": len(self.gpu.held),
               "largest_process_bytes": largest, "mem_available": self.mem_available}
        if self.headroom is not None:
            out.update({"cgroup": self.headroom.cgroup[:512], "cgroup_headroom": self.headroom.bytes})
        return out


def measure(pids: list[int], gpu: GpuStage, store_dir: Path | None) -> Footprint:
    """Measure the tree `pids` (its GPU side through `gpu`, which refuses MIG/MPS in NVML's view)."""
    use = gpu.footprint(pids)
    headroom = host_memory.cgroup_headroom(next(iter(use.held))) if use.held else None
    return Footprint(tree_memory(pids), use, host_memory.node_available(), headroom,
                     free_bytes(store_dir) if store_dir is not None else None)


def tree_memory(pids: list[int]) -> int:
    """Anonymous and shared-memory pages of each process, resident or swapped: what CRIU would write, at
    most (a page shared by several processes counts once per process). A process gone meanwhile counts 0."""
    total = 0
    for pid in pids:
        try:
            status = procfs.status(pid)
        except OSError:
            continue
        total += sum(int(status[f][0]) * 1024 for f in MEMORY_FIELDS if status.get(f, [""])[0].isdigit())
    return total
