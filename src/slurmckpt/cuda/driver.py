"""The CUDA driver's process checkpoint API through ctypes on libcuda.so.1.

One process per call: `cuCheckpointProcess{GetState,Lock,Checkpoint,Restore,Unlock}(int pid, args*)`, called
from the (root) agent on a process of the job. Layouts are those of the CUDA 13.0/13.1 headers (driver 580):

    CUcheckpointLockArgs    {unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7];}
    CUcheckpointRestoreArgs {CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
                             char reserved[44]; cuuint64_t reserved1;}
    CUcheckpointGpuPair     {CUuuid oldUuid; CUuuid newUuid;}

Nothing here runs at import: `load_driver()` opens libcuda (once per process) and calls cuInit(0).
"""
from __future__ import annotations

import ctypes
import enum
import threading
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from slurmckpt.cuda.release import ipc_jobs, release
from slurmckpt.errors import GpuError

LIBRARY = "libcuda.so.1"
CHECKPOINT_SYMBOLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                      "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                      "cuCheckpointProcessGetRestoreThreadId")

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3        # GetState of a process that has no CUDA state
CUDA_ERROR_OPERATING_SYSTEM = 304     # GetState of a pid that does not exist
CUDA_ERROR_NOT_READY = 600            # Lock: submitted work did not finish within timeoutMs

CU_RESULT_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE", 100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT", 304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE", 401: "CUDA_ERROR_ILLEGAL_STATE", 500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED", 802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    909: "CUDA_ERROR_TIMEOUT", 999: "CUDA_ERROR_UNKNOWN",
}


def result_name(code: int) -> str:
    return CU_RESULT_NAMES.get(code, f"CUresult({code})")


class ProcessState(enum.IntEnum):
    """CUprocessState, plus NO_CUDA for a process where GetState answers CUDA_ERROR_NOT_INITIALIZED."""
    NO_CUDA = -1
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class GpuDriverUnavailable(GpuError):
    """libcuda.so.1 is absent, or too old to have the process checkpoint API (needs driver >= 555/570)."""


class GpuDriverError(GpuError):
    """A CUDA call failed. Carries the pid, the operation and the CUresult (code and name)."""

    def __init__(self, op: str, code: int, pid: int | None = None, name: str | None = None,
                 detail: str = "") -> None:
        self.op, self.code, self.pid = op, code, pid
        self.result = name or result_name(code)
        msg = f"{op} failed: {self.result} ({code})" + (f": {detail}" if detail else "")
        super().__init__(msg, pid=pid, op=op, cuda_result=self.result)

    @property
    def timed_out(self) -> bool:
        """The lock waited its timeout for work in flight; TreeGpuStage raises LockContended for it."""
        return self.code == CUDA_ERROR_NOT_READY


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the driver enumerates it. `uuid` in nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    ordinal: int
    uuid: str
    name: str
    total_memory: int
    pci_bus_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"ordinal": self.ordinal, "uuid": self.uuid, "name": self.name,
                "total_memory": self.total_memory, "pci_bus_id": self.pci_bus_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuInfo:
        return cls(int(d["ordinal"]), str(d["uuid"]), str(d["name"]), int(d["total_memory"]),
                   str(d.get("pci_bus_id", "")))


GpuPair = tuple[str, str]       # (uuid at capture, uuid now), both GPU-... strings


@runtime_checkable
class GpuDriver(Protocol):
    def state(self, pid: int) -> ProcessState: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, pairs: Sequence[GpuPair] | None = None) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def restore_thread(self, pid: int) -> int: ...
    def devices(self) -> list[GpuInfo]: ...
    def ipc_jobs(self) -> bool: ...       # checkpoints CUDA IPC within one cuda-checkpoint job (IPC_JOB_RELEASE)


def uuid_to_str(raw: bytes) -> str:
    return "GPU-" + str(uuidlib.UUID(bytes=bytes(raw)))


def uuid_from_str(text: str) -> bytes:
    body = text[4:] if text.upper().startswith("GPU-") else text
    try:
        return uuidlib.UUID(body).bytes
    except ValueError as e:
        raise GpuError(f"not a GPU UUID: {text!r}") from e


# ---- C layouts -------------------------------------------------------------------------------------------

class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]      # c_ubyte, not c_char: c_char arrays stop at a NUL

    @classmethod
    def of(cls, raw: bytes) -> CUuuid:
        return cls((ctypes.c_ubyte * 16).from_buffer_copy(raw))


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


def restore_args(pairs: Sequence[GpuPair] | None) -> tuple[CUcheckpointRestoreArgs | None, Any]:
    """Build restore args for `pairs` (None or empty: no remap, NULL args). Returns (args, keep-alive array)."""
    if not pairs:
        return None, None
    arr = (CUcheckpointGpuPair * len(pairs))()
    for i, (old, new) in enumerate(pairs):
        arr[i].oldUuid = CUuuid.of(uuid_from_str(old))
        arr[i].newUuid = CUuuid.of(uuid_from_str(new))
    args = CUcheckpointRestoreArgs()
    args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(CUcheckpointGpuPair))
    args.gpuPairsCount = len(pairs)
    return args, arr


# ---- the real driver ---------------------------------------------------------------------------------------

class CudaDriver:
    """GpuDriver on libcuda. `lib` may be given (tests); otherwise `library` is opened with ctypes.CDLL."""

    def __init__(self, library: str = LIBRARY, lib: Any = None) -> None:
        if lib is None:
            try:
                lib = ctypes.CDLL(library)
            except OSError as e:
                raise GpuDriverUnavailable(
                    f"cannot load {library}: the NVIDIA driver is not installed on this node ({e})",
                    library=library) from e
        missing = [s for s in CHECKPOINT_SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise GpuDriverUnavailable(
                f"{library} has no CUDA checkpoint API (missing {', '.join(missing)}): the NVIDIA driver is too "
                f"old; GPU checkpoint needs driver >= 570 (580 tested)", library=library)
        self._lib = lib
        self._bind()
        rc = lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise GpuDriverError("cuInit", rc, name=self._name(rc))
        version = ctypes.c_int(0)
        self.version = version.value if lib.cuDriverGetVersion(ctypes.pointer(version)) == 0 else 0
        self.driver_release = release()

    def ipc_jobs(self) -> bool:
        """The same calls, per process, do it (the job is made at launch, not named to the calls): what
        changes is their order (cuda/stage.py). The release decides; no call of 580 tells."""
        return ipc_jobs(self.driver_release)

    def _bind(self) -> None:
        lib, i, p = self._lib, ctypes.c_int, ctypes.c_void_p
        for name, argtypes in (("cuInit", [ctypes.c_uint]), ("cuDriverGetVersion", [p]),
                               ("cuCheckpointProcessGetState", [i, p]), ("cuCheckpointProcessLock", [i, p]),
                               ("cuCheckpointProcessCheckpoint", [i, p]), ("cuCheckpointProcessRestore", [i, p]),
                               ("cuCheckpointProcessUnlock", [i, p]),
                               ("cuCheckpointProcessGetRestoreThreadId", [i, p]), ("cuDeviceGetCount", [p]),
                               ("cuDeviceGet", [p, i]), ("cuDeviceGetName", [ctypes.c_char_p, i, i]),
                               ("cuDeviceTotalMem_v2", [p, i]), ("cuDeviceGetPCIBusId", [ctypes.c_char_p, i, i])):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self._get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid")
        self._get_uuid.argtypes, self._get_uuid.restype = [p, i], ctypes.c_int
        self._error_name = getattr(lib, "cuGetErrorName", None)
        if self._error_name is not None:
            self._error_name.argtypes, self._error_name.restype = [i, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int

    def _name(self, code: int) -> str:
        if self._error_name is not None:
            out = ctypes.c_char_p()
            if self._error_name(code, ctypes.pointer(out)) == 0 and out.value:
                return out.value.decode()
        return result_name(code)

    def _check(self, op: str, rc: int, pid: int | None = None) -> None:
        if rc != CUDA_SUCCESS:
            raise GpuDriverError(op, rc, pid=pid, name=self._name(rc))

    def state(self, pid: int) -> ProcessState:
        out = ctypes.c_int(-1)
        rc = self._lib.cuCheckpointProcessGetState(pid, ctypes.pointer(out))
        if rc == CUDA_ERROR_NOT_INITIALIZED:
            return ProcessState.NO_CUDA
        self._check("cuCheckpointProcessGetState", rc, pid)
        return ProcessState(out.value)

    def lock(self, pid: int, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be > 0 (0 would wait forever)")
        args = CUcheckpointLockArgs(timeoutMs=int(timeout_ms))
        self._check("cuCheckpointProcessLock", self._lib.cuCheckpointProcessLock(pid, ctypes.pointer(args)), pid)

    def checkpoint(self, pid: int) -> None:
        self._check("cuCheckpointProcessCheckpoint", self._lib.cuCheckpointProcessCheckpoint(pid, None), pid)

    def restore(self, pid: int, pairs: Sequence[GpuPair] | None = None) -> None:
        args, keep = restore_args(pairs)
        rc = self._lib.cuCheckpointProcessRestore(pid, ctypes.pointer(args) if args is not None else None)
        del keep
        self._check("cuCheckpointProcessRestore", rc, pid)

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock", self._lib.cuCheckpointProcessUnlock(pid, None), pid)

    def restore_thread(self, pid: int) -> int:
        """The host tid of the thread through which the driver restores `pid`'s GPU state (it answers for a
        stopped process too, as CRIU's cuda plugin relies on)."""
        out = ctypes.c_int(0)
        rc = self._lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.pointer(out))
        self._check("cuCheckpointProcessGetRestoreThreadId", rc, pid)
        return out.value

    def devices(self) -> list[GpuInfo]:
        lib, count = self._lib, ctypes.c_int(0)
        self._check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.pointer(count)))
        out = []
        for ordinal in range(count.value):
            dev, name, bus = ctypes.c_int(0), ctypes.create_string_buffer(256), ctypes.create_string_buffer(32)
            raw, mem = CUuuid(), ctypes.c_size_t(0)
            self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.pointer(dev), ordinal))
            self._check("cuDeviceGetName", lib.cuDeviceGetName(name, 256, dev.value))
            self._check("cuDeviceGetUuid", self._get_uuid(ctypes.pointer(raw), dev.value))
            self._check("cuDeviceTotalMem", lib.cuDeviceTotalMem_v2(ctypes.pointer(mem), dev.value))
            if getattr(lib, "cuDeviceGetPCIBusId", None) is not None:
                self._check("cuDeviceGetPCIBusId", lib.cuDeviceGetPCIBusId(bus, 32, dev.value))
            out.append(GpuInfo(ordinal, uuid_to_str(bytes(raw.bytes)), name.value.decode(),
                               mem.value, bus.value.decode()))
        return out


_loaded: CudaDriver | None = None
_load_lock = threading.Lock()


def load_driver(library: str = LIBRARY) -> CudaDriver:
    """The process-wide CudaDriver, opened on first use (the agent pays cuInit once, not per capture)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            _loaded = CudaDriver(library)
        return _loaded
