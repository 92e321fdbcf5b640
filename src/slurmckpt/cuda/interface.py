"""The GPU step of a rank's capture and restore, behind one small interface (RankGpu). GPU-less trees get
NullGpu and never load libcuda or NVML; trees with CUDA processes get the CUDA one (cuda/rank_stage.CudaRankGpu)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class GpuUse:
    """What a tree holds on its GPUs, measured before anything is locked (the SIZE phase, rank/fit.py)."""
    held: dict[int, dict[str, int]] = field(default_factory=dict)   # pid -> {GPU uuid: bytes}
    notes: tuple[str, ...] = ()          # for the job's stderr: allocators holding far more than used

    @property
    def bytes(self) -> int:
        return sum(sum(per_gpu.values()) for per_gpu in self.held.values())


def holds_gpu_state(record: dict[str, Any] | None) -> bool:
    """A capture's GPU record with processes: criu restores that tree stopped, until its GPU state is back."""
    return bool(record and record.get("processes"))


class RankGpu(Protocol):
    def refusals(self, pids: list[int]) -> list[str]: ...  # check: what the driver cannot capture (no libcuda)
    def footprint(self, pids: list[int]) -> GpuUse: ...   # SIZE: bytes per process; refuses what cannot be
    def lock(self, pids: list[int]) -> None: ...          # PREPARE: lock every CUDA process (timeout)
    def unlock(self) -> None: ...                          # undo of lock
    def checkpoint(self) -> dict[str, Any] | None: ...               # CAPTURE: device memory -> host; record for rank.json
    def resume(self) -> None: ...                          # after a periodic capture: restore + unlock
    def stops_for_resume(self) -> bool: ...                # criu leaves the tree stopped after the dump
    def left_stopped(self, pids: list[int]) -> None: ...   # ...these: resume() (or unlock()) lets them go
    def check_restore(self, record: dict[str, Any] | None) -> None: ...   # before criu restore: GPUs here fit the record
    def restore(self, record: dict[str, Any] | None, pids: list[int]) -> None: ...   # after criu restore


class NullGpu:
    """No CUDA in the tree: every step is a no-op."""

    def refusals(self, pids: list[int]) -> list[str]:
        return []

    def footprint(self, pids: list[int]) -> GpuUse:
        return GpuUse()

    def lock(self, pids: list[int]) -> None:
        pass

    def unlock(self) -> None:
        pass

    def checkpoint(self) -> dict[str, Any] | None:
        return None

    def resume(self) -> None:
        pass

    def stops_for_resume(self) -> bool:
        return False

    def left_stopped(self, pids: list[int]) -> None:
        pass

    def check_restore(self, record: dict[str, Any] | None) -> None:
        self.restore(record, [])

    def restore(self, record: dict[str, Any] | None, pids: list[int]) -> None:
        if record and record.get("processes"):
            from slurmckpt.errors import GpuError
            raise GpuError("checkpoint holds GPU state but this agent has no GPU stage")
