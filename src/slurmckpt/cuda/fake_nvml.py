"""A stand-in for the pynvml module without a GPU: the functions and constants inventory.NvmlInventory uses,
with pynvml's names, return shapes (structs with .total/.used/.free, .busId as bytes, process objects with
.pid/.usedGpuMemory) and errors (NVMLError carrying .value). tests/unit/cuda/test_gpu_inventory.py checks every
name here against the real pynvml, so the fake cannot drift from it unnoticed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3

H200_BYTES = 150_754_820_096       # an H200's total memory as NVML reports it (143771 MiB)


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        names = {NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_UNINITIALIZED: "Uninitialized",
                 NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found"}
        return names.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeNvmlGpu:
    uuid: str
    name: str = "NVIDIA H200"
    memory_total: int = H200_BYTES
    pci_bus_id: str = "00000000:18:00.0"
    mig: int | None = 0                      # None: the GPU has no MIG (NVML answers Not Supported)
    compute_mode: int = NVML_COMPUTEMODE_DEFAULT
    base_used: int = 600 << 20               # what the driver holds with no process on the GPU
    processes: dict[int, int | None] = field(default_factory=dict)      # pid -> bytes (None: unknown)
    mps_clients: dict[int, int] = field(default_factory=dict)


class FakeNvml:
    """Module-like: pass it where NvmlInventory takes `nvml`. `init_error` makes nvmlInit fail with it."""
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeNvmlGpu], driver_version: str = "580.159.04", cuda_version: int = 13000,
                 init_error: int | None = None) -> None:
        self.gpus, self.driver_version, self.cuda_version = gpus, driver_version, cuda_version
        self.init_error = init_error
        self.initialised = False
        self.calls = 0
        for name, value in globals().items():
            if name.startswith("NVML_"):
                setattr(self, name, value)

    @classmethod
    def of(cls, *uuids: str, **gpu: object) -> FakeNvml:
        return cls([FakeNvmlGpu(u, pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", **gpu)  # type: ignore[arg-type]  # tests name fields
                    for i, u in enumerate(uuids)])

    def run(self, pid: int, uuid: str, used: int | None, mps: bool = False) -> None:
        """Process `pid` holds `used` bytes on GPU `uuid` (an MPS client if `mps`)."""
        gpu = next(g for g in self.gpus if g.uuid == uuid)
        (gpu.mps_clients if mps else gpu.processes)[pid] = used  # type: ignore[assignment]  # None: NVML hides the bytes

    # ---- the pynvml functions NvmlInventory calls ----
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def _gpu(self, handle: object) -> FakeNvmlGpu:
        self.calls += 1
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeNvmlGpu):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlGpu:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: object) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle: object) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).pci_bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> SimpleNamespace:
        g = self._gpu(handle)
        used = g.base_used + sum(v or 0 for v in g.processes.values()) + sum(g.mps_clients.values())
        return SimpleNamespace(total=g.memory_total, used=min(used, g.memory_total),
                               free=max(0, g.memory_total - used))

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:
        g = self._gpu(handle)
        if g.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [g.mig, g.mig]

    def nvmlDeviceGetComputeMode(self, handle: object) -> int:
        return self._gpu(handle).compute_mode

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in self._gpu(handle).processes.items()]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: object) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in self._gpu(handle).mps_clients.items()]
