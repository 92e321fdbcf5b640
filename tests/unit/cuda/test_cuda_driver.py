"""slurmckpt.cuda.driver without a GPU: C layouts, UUIDs, errors, and the calls as libcuda sees them (a fake lib
object standing in for the ctypes.CDLL)."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurmckpt.cuda import driver as drv
from slurmckpt.cuda.driver import (CudaDriver, CUcheckpointGpuPair, CUcheckpointLockArgs, CUcheckpointRestoreArgs,
                                   GpuDriverError, GpuDriverUnavailable, ProcessState)
from slurmckpt.errors import GpuError

SRC = Path(__file__).resolve().parents[3] / "src"
H200 = "GPU-00a1b2c3-0000-4000-8000-00000000ff00"     # zero bytes inside: c_char arrays would cut them


def test_struct_layouts_match_cuda_13_headers():
    assert ctypes.sizeof(CUcheckpointLockArgs) == 64
    assert CUcheckpointLockArgs.timeoutMs.offset == 0 and CUcheckpointLockArgs.reserved1.offset == 8
    assert ctypes.sizeof(CUcheckpointGpuPair) == 32 and CUcheckpointGpuPair.newUuid.offset == 16
    assert ctypes.sizeof(CUcheckpointRestoreArgs) == 64
    assert CUcheckpointRestoreArgs.gpuPairs.offset == 0
    assert CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert CUcheckpointRestoreArgs.reserved.offset == 12
    assert CUcheckpointRestoreArgs.reserved1.offset == 56


def test_uuid_round_trip_keeps_zero_bytes():
    raw = drv.uuid_from_str(H200)
    assert len(raw) == 16 and raw.count(0) > 4
    assert drv.uuid_to_str(raw) == H200
    assert drv.uuid_to_str(bytes(drv.CUuuid.of(raw).bytes)) == H200
    with pytest.raises(GpuError, match="not a GPU UUID"):
        drv.uuid_from_str("GPU-nope")


def test_restore_args_carry_every_pair():
    other = "GPU-ffffffff-1111-4222-8333-444444444444"
    args, keep = drv.restore_args([(H200, other), (other, H200)])
    assert args.gpuPairsCount == 2
    assert drv.uuid_to_str(bytes(args.gpuPairs[0].oldUuid.bytes)) == H200
    assert drv.uuid_to_str(bytes(args.gpuPairs[0].newUuid.bytes)) == other
    assert drv.uuid_to_str(bytes(args.gpuPairs[1].newUuid.bytes)) == H200
    assert drv.restore_args(None) == (None, None) and drv.restore_args([]) == (None, None)


def test_absent_library_is_a_clear_error():
    with pytest.raises(GpuDriverUnavailable, match="cannot load libcuda-does-not-exist.so.1.*not installed"):
        CudaDriver("libcuda-does-not-exist.so.1")


def test_driver_without_checkpoint_symbols_is_too_old():
    with pytest.raises(GpuDriverUnavailable, match=r"too old.*|missing cuCheckpointProcessGetState") as e:
        CudaDriver("libc.so.6")
    assert "cuCheckpointProcessLock" in str(e.value) and "too old" in str(e.value)


class FakeLib:
    """Stands in for ctypes.CDLL("libcuda.so.1"): records what the driver passes, answers with `codes`."""

    def __init__(self, state: int = 0, codes: dict[str, int] | None = None, init: int = 0):
        self.codes, self.seen, self._state, self._init = codes or {}, {}, state, init
        for name in drv.CHECKPOINT_SYMBOLS:
            setattr(self, name, self._make(name))
        for name in ("cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName",
                     "cuDeviceGetUuid_v2", "cuDeviceTotalMem_v2", "cuDeviceGetPCIBusId"):
            method = getattr(self, name)      # plain functions: the driver sets argtypes/restype on them
            setattr(self, name, lambda *a, m=method: m(*a))

    def _make(self, name):
        def fn(pid, args):
            self.seen[name] = (pid, args)
            if name == "cuCheckpointProcessGetState" and not self.codes.get(name):
                args.contents.value = self._state
            if name == "cuCheckpointProcessGetRestoreThreadId":
                args.contents.value = pid + 35
            if name == "cuCheckpointProcessLock":
                self.seen["timeoutMs"] = args.contents.timeoutMs
            if name == "cuCheckpointProcessRestore" and args is not None:
                a = args.contents
                self.seen["pairs"] = [(drv.uuid_to_str(bytes(a.gpuPairs[i].oldUuid.bytes)),
                                       drv.uuid_to_str(bytes(a.gpuPairs[i].newUuid.bytes)))
                                      for i in range(a.gpuPairsCount)]
            return self.codes.get(name, 0)
        return fn

    def cuInit(self, flags):
        return self._init

    def cuDriverGetVersion(self, out):
        out.contents.value = 13000
        return 0

    def cuDeviceGetCount(self, out):
        out.contents.value = 2
        return 0

    def cuDeviceGet(self, out, ordinal):
        out.contents.value = 10 + ordinal
        return 0

    def cuDeviceGetName(self, buf, n, dev):
        name = b"NVIDIA H200\0"
        ctypes.memmove(buf, name, len(name))
        return 0

    def cuDeviceGetUuid_v2(self, out, dev):
        raw = drv.uuid_from_str(H200)[:-1] + bytes([dev])
        out.contents.bytes[:] = list(raw)
        return 0

    def cuDeviceTotalMem_v2(self, out, dev):
        out.contents.value = 150_754_820_096
        return 0

    def cuDeviceGetPCIBusId(self, buf, n, dev):
        bus = f"0000:{dev:02X}:00.0\0".encode()
        ctypes.memmove(buf, bus, len(bus))
        return 0


def test_calls_reach_libcuda_with_pid_timeout_and_pairs():
    lib = FakeLib(state=1)
    d = CudaDriver(lib=lib)
    assert d.version == 13000
    assert d.state(4242) is ProcessState.LOCKED
    d.lock(4242, 750)
    assert lib.seen["cuCheckpointProcessLock"][0] == 4242 and lib.seen["timeoutMs"] == 750
    d.checkpoint(4242)
    d.restore(4242, None)
    assert lib.seen["cuCheckpointProcessRestore"][1] is None
    other = "GPU-ffffffff-1111-4222-8333-444444444444"
    d.restore(4242, [(H200, other)])
    assert lib.seen["pairs"] == [(H200, other)]
    d.unlock(4242)
    assert lib.seen["cuCheckpointProcessUnlock"][0] == 4242
    with pytest.raises(ValueError):
        d.lock(4242, 0)


def test_errors_carry_pid_op_and_result_name():
    lib = FakeLib(codes={"cuCheckpointProcessLock": 600, "cuCheckpointProcessCheckpoint": 801})
    d = CudaDriver(lib=lib)
    with pytest.raises(GpuDriverError) as e:
        d.lock(77, 100)
    assert (e.value.pid, e.value.op, e.value.code, e.value.result) == (77, "cuCheckpointProcessLock", 600,
                                                                       "CUDA_ERROR_NOT_READY")
    assert e.value.timed_out        # TreeGpuStage turns this one into LockContended (test_cuda_stage.py)
    assert "pid=77" in str(e.value) and "CUDA_ERROR_NOT_READY" in str(e.value)
    with pytest.raises(GpuDriverError) as e:
        d.checkpoint(77)
    assert e.value.result == "CUDA_ERROR_NOT_SUPPORTED" and not e.value.retryable
    assert isinstance(e.value, GpuError)


def test_state_of_a_process_without_cuda_and_of_a_missing_pid():
    assert CudaDriver(lib=FakeLib(codes={"cuCheckpointProcessGetState": 3})).state(1) is ProcessState.NO_CUDA
    with pytest.raises(GpuDriverError, match="CUDA_ERROR_OPERATING_SYSTEM"):
        CudaDriver(lib=FakeLib(codes={"cuCheckpointProcessGetState": 304})).state(999999)


def test_cuinit_failure_is_reported():
    with pytest.raises(GpuDriverError, match="cuInit failed: CUDA_ERROR_NO_DEVICE"):
        CudaDriver(lib=FakeLib(init=100))


def test_devices_are_decoded():
    gpus = CudaDriver(lib=FakeLib()).devices()
    assert [g.ordinal for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H200" and gpus[0].total_memory == 150_754_820_096
    assert gpus[0].uuid == H200[:-2] + "0a" and gpus[1].uuid == H200[:-2] + "0b"
    assert gpus[1].pci_bus_id == "0000:0B:00.0"
    assert drv.GpuInfo.from_dict(gpus[1].to_dict()) == gpus[1]


def test_load_driver_opens_libcuda_once(monkeypatch):
    made = []
    monkeypatch.setattr(drv, "_loaded", None)
    monkeypatch.setattr(drv, "CudaDriver", lambda library: made.append(library) or object())
    first = drv.load_driver()
    assert drv.load_driver() is first and made == ["libcuda.so.1"]


def test_importing_slurmckpt_and_the_gpu_modules_never_loads_a_library():
    code = textwrap.dedent("""
        import ctypes
        def refuse(*a, **k):
            raise AssertionError(f"library loaded at import: {a}")
        ctypes.CDLL = refuse
        ctypes.cdll.LoadLibrary = refuse
        import slurmckpt, slurmckpt.cuda, slurmckpt.cuda.driver, slurmckpt.cuda.fake, slurmckpt.cuda.stage
        import slurmckpt.cuda.remap, slurmckpt.barrier.rounds
        assert slurmckpt.cuda.driver._loaded is None
        print("clean")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr


def test_restore_thread_reads_the_drivers_tid_and_names_a_failure():
    lib = FakeLib()
    assert CudaDriver(lib=lib).restore_thread(1400) == 1435
    failing = FakeLib(codes={"cuCheckpointProcessGetRestoreThreadId": 304})
    with pytest.raises(GpuDriverError, match="cuCheckpointProcessGetRestoreThreadId") as e:
        CudaDriver(lib=failing).restore_thread(1400)
    assert e.value.pid == 1400
