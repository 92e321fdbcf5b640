"""The GPU step of a rank's pipeline, behind one small interface. GPU-less trees get NullGpu and never load
libcuda; trees with CUDA processes get the CUDA driver stage (slurmckpt.cuda)."""
from __future__ import annotations

from typing import Protocol


class GpuStage(Protocol):
    def lock(self, pids: list[int]) -> None: ...          # PREPARE: lock every CUDA process (timeout)
    def unlock(self) -> None: ...                          # undo of lock
    def checkpoint(self) -> dict | None: ...               # CAPTURE: device memory -> host; record for rank.json
    def resume(self) -> None: ...                          # after a periodic capture: restore + unlock
    def restore(self, record: dict | None, pids: list[int]) -> None: ...   # after criu restore


class NullGpu:
    """No CUDA in the tree: every step is a no-op."""

    def lock(self, pids: list[int]) -> None:
        pass

    def unlock(self) -> None:
        pass

    def checkpoint(self) -> dict | None:
        return None

    def resume(self) -> None:
        pass

    def restore(self, record: dict | None, pids: list[int]) -> None:
        if record:
            from slurmckpt.errors import GpuError
            raise GpuError("checkpoint holds GPU state but this agent has no GPU stage")
