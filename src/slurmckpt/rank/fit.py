"""What one rank's capture will take, measured in the epoch's SIZE phase before anything is locked or frozen,
and the refusal of a capture that cannot fit (docs/gpu.md, "Large GPU memory", "Host memory of a GPU capture").

    host_bytes   the tree's memory CRIU writes: anonymous and shared pages, resident or swapped
    gpu_bytes    device memory of each CUDA process (NVML); the GPU checkpoint copies it into that process's
                 host memory, and CRIU then writes it with the rest
    image_bytes  host_bytes + gpu_bytes: what the rank's images take

The GPU copy must fit in the node's MemAvailable, and in every memory cgroup above the CUDA processes with
what is resident there already (host_memory.py); where the agent, whose criu writes the images through the
page cache, is charged to that cgroup too (Slurm's job cgroup holds slurmstepd's), the images' pages count as
well. Past a limit the OOM killer ends the job inside its capture, or memory.high throttles it to a crawl.
A refusal names the --mem the job needs; a site may instead let root raise Slurm's limits for the capture
(`gpu_capture_memory_raise`: `raises`, applied in PREPARE and put back after). The images must fit in the
store's file system. The coordinator then checks the sums of ranks that share a node or a cgroup
(coordinator/budget.py) and derives the phase timeouts from the bytes, from the `sized` reply (`reply`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmckpt.node import procfs
from slurmckpt.node import host_memory
from slurmckpt.store.durable import free_bytes      # the one free-space read (space.py reserves by it too)
from slurmckpt.cuda.interface import GpuUse, RankGpu
from slurmckpt.node.host_memory import Headroom
from slurmckpt.sizes import size_text

MEMORY_FIELDS = ("RssAnon", "RssShmem", "VmSwap")     # /proc/PID/status, kB
GIB = 1 << 30


@dataclass(frozen=True)
class Footprint:
    host_bytes: int
    gpu: GpuUse
    mem_available: int
    levels: tuple[Headroom, ...]   # the memory cgroups above the CUDA processes that have a limit
    store_free: int | None         # bytes free where the images go; None: not known
    raise_allowed: bool = False    # the site lets root raise Slurm's limits for a capture

    @property
    def gpu_bytes(self) -> int:
        return self.gpu.bytes

    @property
    def image_bytes(self) -> int:
        return self.host_bytes + self.gpu_bytes

    def added_to(self, level: Headroom) -> int:
        """What the capture adds to `level`: the GPU copy, and the images' page cache where criu writes from it."""
        return self.gpu_bytes + (self.image_bytes if level.writer_inside else 0)

    def need(self, level: Headroom) -> int:
        return level.resident + self.added_to(level)

    @property
    def raises(self) -> list[tuple[Headroom, int]]:
        """The levels root raises for this capture (by what it adds to each): where it would not fit."""
        return [(lv, self.added_to(lv)) for lv in self.levels
                if self.raise_allowed and lv.raisable and self.gpu_bytes and self.need(lv) > lv.limit]

    def refusals(self) -> list[str]:
        """What does not fit, each naming the resource, the need and the shortfall."""
        out, gpu = [], self.gpu_bytes
        procs = f"{len(self.gpu.held)} CUDA process(es)"
        if gpu > self.mem_available:
            out.append(f"the GPU checkpoint copies {size_text(gpu)} of device memory ({procs}) into host memory, but the "
                       f"node has {size_text(self.mem_available)} available (MemAvailable): {size_text(gpu - self.mem_available)} "
                       "short")
        raised = {lv.cgroup for lv, _ in self.raises}
        short = [lv for lv in self.levels if gpu and self.need(lv) > lv.limit and lv.cgroup not in raised]
        if short:
            out.append(self._short(max(short, key=lambda lv: self.need(lv) - lv.limit), procs))
        if self.store_free is not None and self.image_bytes > self.store_free:
            out.append(f"the images take about {size_text(self.image_bytes)} (host {size_text(self.host_bytes)} + GPU {size_text(gpu)}), "
                       f"but the image store has {size_text(self.store_free)} free: "
                       f"{size_text(self.image_bytes - self.store_free)} short")
        return out

    def _short(self, lv: Headroom, procs: str) -> str:
        need = self.need(lv)
        pages = (f", and the images' page cache of {size_text(self.image_bytes)} (slurmckpt's criu writes them from "
                 "inside this cgroup)") if lv.writer_inside else ""
        return (f"the job's memory limit cannot hold the capture: ask Slurm for --mem={-(-need // GIB)}G or more, "
                f"or hold less GPU memory. Its memory cgroup {lv.cgroup} (limit {size_text(lv.limit)}) would need "
                f"{size_text(need)}, {size_text(need - lv.limit)} more: the job's {size_text(lv.resident)} in use there, the "
                f"GPU checkpoint's copy of {size_text(self.gpu_bytes)} of device memory ({procs}) into the job's host "
                f"memory{pages}")

    def notes(self) -> list[str]:
        """For the job's stderr, once a run: a raise the site makes for every capture."""
        return [f"memory: a capture adds {size_text(by)} to memory cgroup {lv.cgroup} (limit {size_text(lv.limit)}, "
                f"{size_text(lv.resident)} in use): root raises its limit by that much for the capture and puts it back "
                "after (the site's gpu_capture_memory_raise)" for lv, by in self.raises]

    def reply(self) -> dict[str, Any]:
        """The rank's `sized` reply (validated by coordinator/budget.RankSize.from_reply): the room the
        tightest level not raised leaves for the GPU copies of the ranks under it."""
        largest = max((sum(g.values()) for g in self.gpu.held.values()), default=0)
        out: dict[str, Any] = {"host_bytes": self.host_bytes, "gpu_bytes": self.gpu_bytes, "gpu_processes": len(self.gpu.held),
               "largest_process_bytes": largest, "mem_available": self.mem_available}
        raised = {lv.cgroup for lv, _ in self.raises}
        rooms = [(lv.limit - self.need(lv) + self.gpu_bytes, lv) for lv in self.levels if lv.cgroup not in raised]
        if rooms:
            room, lv = min(rooms, key=lambda r: r[0])
            out.update({"cgroup": lv.cgroup[:512], "cgroup_headroom": max(0, room)})
        return out


def measure(pids: list[int], gpu: RankGpu, store_dir: Path | None, raise_allowed: bool = False) -> Footprint:
    """Measure the tree `pids` (its GPU side through `gpu`, which refuses MIG/MPS in NVML's view); the memory
    cgroups are those of its first CUDA process, with this process (the agent) as the images' writer."""
    use = gpu.footprint(pids)
    levels = host_memory.levels(next(iter(use.held)), os.getpid()) if use.held else []
    return Footprint(tree_memory(pids), use, host_memory.node_available(), tuple(levels),
                     free_bytes(store_dir) if store_dir is not None else None, raise_allowed)


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
