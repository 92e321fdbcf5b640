"""The node's GPUs as NVML sees them, through pynvml (the pip package nvidia-ml-py): chip, memory, MIG mode,
compute mode, and how many bytes each process holds on each GPU (MPS clients listed apart). What a GPU *is*
and how full it is comes from here; the CUDA driver API (driver.py) is used only for the checkpoint calls.

Nothing here imports pynvml or loads libnvidia-ml.so.1 before a GPU is needed: `load_inventory()` does, once
per process (nvmlInit), and only for a tree that holds CUDA state, a restore with GPU state, or `slurmckpt
doctor`. Missing either raises NvmlUnavailable naming what to install (docs/gpu.md, "Requirements").

NVML reports processes by their pid in the initial PID namespace; the agent runs there and reads the tree's
pids from its cgroup, so both name a process the same way.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from slurmckpt.errors import GpuError
from slurmckpt.sizes import size_text

COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
MIN_DRIVER = 570          # the CUDA process checkpoint API with restore onto other GPUs (580 tested)


class NvmlUnavailable(GpuError):
    """pynvml is not installed in the agent's Python, or libnvidia-ml.so.1 cannot be loaded or initialised."""


@dataclass(frozen=True)
class GpuDevice:
    index: int                  # NVML's index (PCI bus order); not CUDA's ordinal
    uuid: str                   # GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi prints it
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    mig_enabled: bool
    compute_mode: str           # COMPUTE_MODES' names

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True)
class ProcessUse:
    pid: int
    uuid: str                   # the GPU
    used_bytes: int | None      # None: NVML could not tell
    mps: bool = False           # listed as an MPS client of that GPU


@dataclass(frozen=True)
class Inventory:
    driver_version: str
    cuda_version: int           # 13000 for CUDA 13.0
    gpus: tuple[GpuDevice, ...]
    processes: tuple[ProcessUse, ...]

    def gpu(self, uuid: str) -> GpuDevice | None:
        return next((g for g in self.gpus if same_uuid(g.uuid, uuid)), None)

    def held_by(self, pids: Iterable[int]) -> dict[int, dict[str, int]]:
        """pid -> {GPU uuid: bytes} for the given pids that hold device memory (unknown sizes count 0)."""
        wanted, out = set(pids), dict[int, Any]()
        for use in self.processes:
            if use.pid in wanted and not use.mps:
                per_gpu = out.setdefault(use.pid, {})
                per_gpu[use.uuid] = per_gpu.get(use.uuid, 0) + (use.used_bytes or 0)
        return out

    def refusals(self, pids: Iterable[int]) -> list[str]:
        """What NVML shows that the CUDA checkpoint API cannot capture, for these pids (cuda/procscan.py
        gives the /proc view of the same refusals; both are checked)."""
        reasons, wanted = [], set(pids)
        for use in self.processes:
            if use.pid not in wanted:
                continue
            gpu = self.gpu(use.uuid)
            if use.mps:
                reasons.append(f"pid {use.pid} is an MPS client on {_label(gpu, use.uuid)} (NVML): MPS is not "
                               "supported by the CUDA checkpoint API")
            elif gpu is not None and gpu.mig_enabled:
                reasons.append(f"pid {use.pid} runs on {_label(gpu, use.uuid)}, which is in MIG mode (NVML): "
                               "MIG is not supported by the CUDA checkpoint API")
        return sorted(set(reasons))

    def describe(self) -> list[str]:
        """One line per GPU, for `slurmckpt doctor`."""
        lines = [f"NVIDIA driver {self.driver_version}, CUDA {self.cuda_version // 1000}."
                 f"{self.cuda_version % 1000 // 10}, {len(self.gpus)} GPU(s)"]
        for g in self.gpus:
            procs = [p for p in self.processes if same_uuid(p.uuid, g.uuid)]
            lines.append(f"GPU {g.index} {g.name} {g.uuid} bus {g.pci_bus_id}: {size_text(g.memory_total)} total, "
                         f"{size_text(g.memory_used)} used, {len(procs)} process(es); MIG "
                         f"{'on' if g.mig_enabled else 'off'}, compute mode {g.compute_mode}")
        return lines


class GpuInventory(Protocol):
    def snapshot(self) -> Inventory: ...


def same_uuid(a: str, b: str) -> bool:
    return a.lower() == b.lower()


def _label(gpu: GpuDevice | None, uuid: str) -> str:
    return f"GPU {gpu.index} ({gpu.name}, {uuid})" if gpu else f"GPU {uuid}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlInventory:
    """GpuInventory on pynvml. `nvml` may be given (tests: cuda/fake_nvml.py); else pynvml is imported."""

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]  # the optional module in the parameter's place
            except ImportError as e:
                raise NvmlUnavailable(
                    f"pynvml is not installed for {sys.executable}: GPU capture needs it to size and check the "
                    "job's GPUs (install the pip package nvidia-ml-py, e.g. `pip install 'slurmckpt[gpu]'`)") from e
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML (libnvidia-ml.so.1, part of the NVIDIA driver) cannot be used on this "
                                  f"node: {e}") from e

    def snapshot(self) -> Inventory:
        n = self.nvml
        try:
            gpus, processes = [], []
            for index in range(n.nvmlDeviceGetCount()):
                handle = n.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(n.nvmlDeviceGetUUID(handle))
                memory = n.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(GpuDevice(index, uuid, _text(n.nvmlDeviceGetName(handle)),
                                      _text(n.nvmlDeviceGetPciInfo(handle).busId), int(memory.total),
                                      int(memory.used), self._optional(n.nvmlDeviceGetMigMode, handle, [0])[0] == 1,
                                      COMPUTE_MODES.get(n.nvmlDeviceGetComputeMode(handle), "UNKNOWN")))
                for info in n.nvmlDeviceGetComputeRunningProcesses(handle):
                    processes.append(ProcessUse(int(info.pid), uuid, _bytes(info.usedGpuMemory)))
                for info in self._optional(n.nvmlDeviceGetMPSComputeRunningProcesses, handle, []):
                    processes.append(ProcessUse(int(info.pid), uuid, _bytes(info.usedGpuMemory), mps=True))
            return Inventory(_text(n.nvmlSystemGetDriverVersion()), int(n.nvmlSystemGetCudaDriverVersion()),
                             tuple(gpus), tuple(processes))
        except n.NVMLError as e:
            raise GpuError(f"NVML query failed: {e}") from e

    def _optional(self, fn: Any, handle: Any, default: Any) -> Any:
        """A query some GPUs do not support (MIG mode on a GPU without MIG, MPS lists): its default then."""
        try:
            return fn(handle)
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) in (self.nvml.NVML_ERROR_NOT_SUPPORTED,
                                             self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return default
            raise


def _bytes(value: Any) -> int | None:
    return None if value is None else int(value)


_loaded: NvmlInventory | None = None
_load_lock = threading.Lock()


def load_inventory() -> NvmlInventory:
    """The process-wide NvmlInventory, initialised on first use (the agent pays nvmlInit once)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            _loaded = NvmlInventory()
        return _loaded


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode, the bracketed word of e.g. "always [madvise] never"."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), None)


def thp_check(path: Path = THP_ENABLED) -> tuple[bool | None, str, str]:
    """A warning unless THP is `always`: each stage of a GPU capture took 20-38 % less time with it (docs/gpu.md,
    "Transparent huge pages on GPU nodes"); slurmckpt leaves that node-wide policy to the admin."""
    mode = thp_mode(path)
    if mode == "always":
        return True, "transparent huge pages", f"always ({path})"
    return None, "transparent huge pages", (f"{mode or 'unknown'} ({path}): GPU captures and restores take "
                                            "20-38 % less time with `always` (docs/gpu.md, \"Transparent "
                                            "huge pages on GPU nodes\")")


def doctor_checks(device: Path = Path("/dev/nvidiactl"),
                  inventory: Callable[[], GpuInventory] = load_inventory,
                  thp: Path = THP_ENABLED, staging: Path | None = None) -> list[tuple[bool | None, str, str]]:
    """`slurmckpt doctor`'s GPU lines: (ok, what, detail), ok None for a warning. None on a node without the
    NVIDIA driver. With `staging` (the config's staging_dir), whether the GPUs' memory fits under the node's
    writeback limit (node/writeback.py)."""
    if not device.exists():
        return []
    try:
        inv = inventory().snapshot()
    except GpuError as e:
        return [(False, "GPU inventory (NVML)", str(e))]
    major = int(inv.driver_version.split(".")[0]) if inv.driver_version.split(".")[0].isdigit() else 0
    out: list[tuple[bool | None, str, str]] = [(major >= MIN_DRIVER, "NVIDIA driver", inv.describe()[0] + ("" if major >= MIN_DRIVER else
                                                                       f" (GPU checkpoint needs >= {MIN_DRIVER})"))]
    for gpu, line in zip(inv.gpus, inv.describe()[1:]):
        out.append((not gpu.mig_enabled, f"GPU {gpu.index}", line + (" (MIG GPUs cannot be checkpointed)"
                                                                       if gpu.mig_enabled else "")))
    out.append(thp_check(thp))
    if staging is not None:
        from slurmckpt.node import writeback
        out.append(writeback.check(sum(g.memory_total for g in inv.gpus), staging))
    return out
