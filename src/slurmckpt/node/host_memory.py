"""How much more host memory a process may take before something gives: the node's MemAvailable, and the
tightest memory cgroup limit above the process (Slurm's job, step or task cgroup with ConstrainRAMSpace).

Why a capture asks: the CUDA driver's checkpoint copies a process's device memory into fresh host memory of
that same process. The copy is charged to the process's memory cgroup; past the limit the kernel's OOM
killer ends the job in the middle of its capture. A capture whose GPU copy does not fit is refused before
anything is locked (rank/fit.py; docs/gpu.md, "Large GPU memory").

Room left in a cgroup = limit - usage + its page cache (active_file + inactive_file: reclaimed before the
OOM killer acts; shmem is not in it). Every ancestor up to the hierarchy's root counts; the smallest wins.
cgroup v2: memory.max / memory.current / memory.stat; v1 (memory controller): memory.limit_in_bytes /
memory.usage_in_bytes / memory.stat (total_* counters).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slurmckpt.node import procfs
from slurmckpt.node.task_cgroup import cgroup_mounts

V1_UNLIMITED = 1 << 62       # v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 bytes)


@dataclass(frozen=True)
class Headroom:
    bytes: int            # what may still be added
    limit: int            # the limit that leaves the least
    cgroup: str           # which cgroup sets it (its path in its hierarchy)


def node_available() -> int:
    """MemAvailable: what the kernel estimates can be allocated without swapping."""
    return procfs.meminfo()["MemAvailable"]


def cgroup_headroom(pid: int) -> Headroom | None:
    """The least room any memory cgroup above `pid` leaves, or None where no limit applies (or the process
    is gone)."""
    try:
        lines = procfs.cgroups(pid)
        mounts = cgroup_mounts()
    except OSError:
        return None
    v1 = next(((mounts.get(c), path) for _, c, path in lines if "memory" in c.split(",")), None)
    if v1 is not None and v1[0] is not None:
        return _tightest(v1[0], v1[1], _v1_level)
    v2 = next((path for hier, c, path in lines if hier == "0" and not c), None)
    if v2 is not None and mounts.get("0::") is not None:
        return _tightest(mounts["0::"], v2, _v2_level)
    return None


def _tightest(mount: Path, path: str, level: Callable[[Path, str], Headroom | None]) -> Headroom | None:
    best: Headroom | None = None
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        rel = "/" + "/".join(parts[:depth])
        found = level(mount / rel.lstrip("/"), rel)
        if found is not None and (best is None or found.bytes < best.bytes):
            best = found
    return best


def _v2_level(d: Path, rel: str) -> Headroom | None:
    limit = _read(d / "memory.max")
    if limit in (None, "max"):
        return None
    stat = _stat(d / "memory.stat")
    usage = int(_read(d / "memory.current") or 0)
    room = int(limit) - usage + stat.get("active_file", 0) + stat.get("inactive_file", 0)
    return Headroom(max(0, room), int(limit), rel)


def _v1_level(d: Path, rel: str) -> Headroom | None:
    limit = _read(d / "memory.limit_in_bytes")
    if limit is None or int(limit) >= V1_UNLIMITED:
        return None
    stat = _stat(d / "memory.stat")
    usage = int(_read(d / "memory.usage_in_bytes") or 0)
    room = int(limit) - usage + stat.get("total_active_file", 0) + stat.get("total_inactive_file", 0)
    return Headroom(max(0, room), int(limit), rel)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out
