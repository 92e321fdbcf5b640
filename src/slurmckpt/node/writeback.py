"""The kernel's writeback limit, as a GPU capture meets it (docs/operations.md, "A GPU node's writeback
limit"). A capture writes each process's host copy into node-local staging while the job is stopped; the
copy runs at memory speed only while the dirty page cache stays under the kernel's limit, after which the
kernel holds the writer to the disk's pace (at 32 GiB on an H100 node: stall 1.51x the driver's own copies
instead of 1.21x). Staging on a tmpfs has no writeback, so no such limit.

The limit is the kernel's own rule (mm/page-writeback.c): `vm.dirty_bytes` when set, otherwise
`vm.dirty_ratio` percent of the memory the kernel counts as dirtyable, its free pages plus its file pages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurmckpt.node import procfs
from slurmckpt.sizes import size_text

IN_MEMORY = frozenset({"tmpfs", "ramfs"})
MOST_RATIO = 90          # a dirty_ratio past this leaves the node no room to breathe: tmpfs staging instead


@dataclass(frozen=True)
class DirtyLimit:
    bytes: int
    ratio: int              # vm.dirty_ratio (0 when vm.dirty_bytes is set)
    dirtyable: int          # what the ratio is of

    def describe(self) -> str:
        if not self.ratio:
            return f"vm.dirty_bytes {size_text(self.bytes)}"
        return f"vm.dirty_ratio {self.ratio} % of ~{size_text(self.dirtyable)}"


def dirty_limit(meminfo: dict[str, int], vm: Callable[[str], int] = procfs.vm_setting) -> DirtyLimit:
    dirtyable = meminfo.get("MemFree", 0) + meminfo.get("Active(file)", 0) + meminfo.get("Inactive(file)", 0)
    fixed = vm("dirty_bytes")
    if fixed:
        return DirtyLimit(fixed, 0, dirtyable)
    ratio = vm("dirty_ratio")
    return DirtyLimit(dirtyable * ratio // 100, ratio, dirtyable)


def fs_type(path: Path, mountinfo: list[str]) -> str:
    """The file system type of the mount that holds `path` (the longest mount point above it)."""
    best, kind = "", ""
    for line in mountinfo:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and after:
            best, kind = point, after[0]
    return kind


def check(gpu_bytes: int, staging_dir: Path, meminfo: dict[str, int] | None = None,
          vm: Callable[[str], int] = procfs.vm_setting,
          mountinfo: list[str] | None = None) -> tuple[bool | None, str, str]:
    """`slurmckpt doctor`'s line on a GPU node: ok, or a warning where the host copy of a capture holding the
    node's whole GPU memory would pass the dirty limit; it names the setting that would hold it."""
    what = "GPU captures and the writeback limit"
    kind = fs_type(staging_dir, procfs.mountinfo() if mountinfo is None else mountinfo)
    if kind in IN_MEMORY:
        return True, what, f"staging {staging_dir} is on {kind}: the host copy never waits on the disk"
    limit = dirty_limit(procfs.meminfo() if meminfo is None else meminfo, vm)
    if gpu_bytes <= limit.bytes:
        return True, what, (f"the GPUs' {size_text(gpu_bytes)} fit under the dirty limit "
                            f"({size_text(limit.bytes)}: {limit.describe()})")
    need = math.ceil(gpu_bytes * 100 / limit.dirtyable) + 5 if limit.dirtyable else 0
    fix = (f"raise vm.dirty_ratio to {need} (or vm.dirty_bytes past {size_text(gpu_bytes)}) or put "
           "staging_dir on a tmpfs" if 0 < need <= MOST_RATIO else "put staging_dir on a tmpfs sized for it")
    return None, what, (f"captures holding more than {size_text(limit.bytes)} of GPU memory per node ("
                        f"{limit.describe()}; the GPUs hold {size_text(gpu_bytes)}) write their host copy at "
                        f"the disk's pace, stopping the job longer: {fix} (docs/operations.md, \"A GPU "
                        "node's writeback limit\")")
