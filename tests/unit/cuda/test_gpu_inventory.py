"""The GPU inventory through NVML: the real NvmlInventory code on a fake pynvml module (cuda/fake_nvml.py)
whose names and constants are checked against the real pynvml, and the real pynvml on this GPU-less machine
(libnvidia-ml.so.1 absent: a clear NvmlUnavailable, never a crash)."""
from __future__ import annotations

import inspect
import sys

import pytest

from slurmckpt.cuda import fake_nvml
from slurmckpt.cuda.fake_nvml import FakeNvml, FakeNvmlGpu
from slurmckpt.cuda.inventory import NvmlInventory, NvmlUnavailable
from slurmckpt.errors import GpuError

A, B = "GPU-00000000-0000-4000-8000-000000000000", "GPU-00000000-0000-4000-8000-000000000001"
GIB = 1 << 30


def test_the_fake_uses_pynvmls_own_names_and_values():
    """Every pynvml function the fake provides exists in the real module with the arguments we pass, and
    every NVML_* constant has the real value: a rename or renumbering upstream fails here, not on the H200."""
    import pynvml
    for name, fn in inspect.getmembers(FakeNvml, inspect.isfunction):
        if name.startswith("nvml"):
            ours = len(inspect.signature(fn).parameters) - 1          # without self
            inspect.signature(getattr(pynvml, name)).bind(*[None] * ours)   # TypeError if the call does not fit
    for name in dir(fake_nvml):
        if name.startswith("NVML_"):
            assert getattr(pynvml, name) == getattr(fake_nvml, name), name
    assert issubclass(pynvml.NVMLError, Exception) and hasattr(pynvml.NVMLError(3), "value")


def test_real_pynvml_without_the_driver_is_a_clear_error():
    """This machine has no NVIDIA driver: the real pynvml fails to load libnvidia-ml.so.1, and the error says
    what is missing where."""
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1.*cannot be used on this node"):
        NvmlInventory()


def test_missing_pynvml_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)       # import pynvml -> ImportError
    with pytest.raises(NvmlUnavailable, match=r"pynvml is not installed for .*nvidia-ml-py"):
        NvmlInventory()


def test_snapshot_reports_gpus_processes_and_modes():
    nvml = FakeNvml([FakeNvmlGpu(A), FakeNvmlGpu(B, pci_bus_id="00000000:19:00.0", mig=None,
                                                  compute_mode=fake_nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)])
    nvml.run(100, A, 80 * GIB)
    nvml.run(100, B, 2 * GIB)
    nvml.run(101, B, None)                      # NVML could not tell
    inv = NvmlInventory(nvml).snapshot()
    assert inv.driver_version == "580.159.04" and inv.cuda_version == 13000
    a, b = inv.gpus
    assert (a.index, a.uuid, a.name, a.pci_bus_id) == (0, A, "NVIDIA H200", "00000000:18:00.0")
    assert a.memory_used == 80 * GIB + (600 << 20) and a.memory_free == a.memory_total - a.memory_used
    assert not b.mig_enabled and b.compute_mode == "EXCLUSIVE_PROCESS"       # no MIG: Not Supported -> off
    assert inv.held_by([100, 101, 999]) == {100: {A: 80 * GIB, B: 2 * GIB}, 101: {B: 0}}
    assert inv.gpu("GPU-" + A[4:].upper()) is a                 # uuids compare case-blind
    lines = inv.describe()
    assert lines[0] == "NVIDIA driver 580.159.04, CUDA 13.0, 2 GPU(s)"
    assert "GPU 1 NVIDIA H200 " + B in lines[2] and "2 process(es)" in lines[2] and "EXCLUSIVE_PROCESS" in lines[2]


def test_mig_and_mps_seen_by_nvml_are_refusals_naming_pid_and_gpu():
    nvml = FakeNvml([FakeNvmlGpu(A, mig=1), FakeNvmlGpu(B)])
    nvml.run(100, A, GIB)
    nvml.run(200, B, GIB, mps=True)
    nvml.run(300, B, GIB)
    inv = NvmlInventory(nvml).snapshot()
    why = inv.refusals([100, 200, 300])
    assert len(why) == 2
    assert f"pid 100 runs on GPU 0 (NVIDIA H200, {A}), which is in MIG mode" in why[0]
    assert f"pid 200 is an MPS client on GPU 1 (NVIDIA H200, {B})" in why[1]
    assert inv.refusals([300]) == [] and inv.held_by([200]) == {}          # an MPS client's bytes are the server's


def test_an_nvml_failure_mid_query_is_a_gpu_error():
    nvml = FakeNvml([FakeNvmlGpu(A)])
    inventory = NvmlInventory(nvml)
    nvml.initialised = False                     # the next call answers Uninitialized
    with pytest.raises(GpuError, match="NVML query failed: Uninitialized"):
        inventory.snapshot()


def test_nvml_init_failure_is_unavailable():
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        NvmlInventory(FakeNvml([], init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND))


def test_doctor_shows_the_inventory_on_a_gpu_node_and_nothing_elsewhere(tmp_path):
    from slurmckpt.cuda.inventory import doctor_checks
    ctl = tmp_path / "nvidiactl"
    nvml = FakeNvml([FakeNvmlGpu(A), FakeNvmlGpu(B, mig=1)])
    assert doctor_checks(ctl, lambda: NvmlInventory(nvml)) == []          # no driver device: no GPU lines
    ctl.touch()
    thp = tmp_path / "enabled"
    thp.write_text("always [madvise] never\n")
    (ok, what, detail), gpu0, gpu1, huge = doctor_checks(ctl, lambda: NvmlInventory(nvml), thp)
    assert ok and what == "NVIDIA driver" and detail == "NVIDIA driver 580.159.04, CUDA 13.0, 2 GPU(s)"
    assert gpu0[0] and gpu0[1] == "GPU 0" and A in gpu0[2]
    assert not gpu1[0] and "MIG GPUs cannot be checkpointed" in gpu1[2]
    assert huge[0] is None and huge[1] == "transparent huge pages" and huge[2].startswith("madvise (")
    old = FakeNvml([FakeNvmlGpu(A)], driver_version="550.54.15")
    assert doctor_checks(ctl, lambda: NvmlInventory(old), thp)[0][0] is False
    (failed,) = doctor_checks(ctl, lambda: NvmlInventory(FakeNvml([], init_error=12)), thp)
    assert failed[0] is False and "NVML" in failed[2]


def test_the_transparent_huge_page_mode_is_read_from_the_bracketed_word(tmp_path):
    """THP `always` is an ok line, any other mode or an unreadable file a warning (never a failure) that
    points at the measured difference in docs/gpu.md."""
    from slurmckpt.cuda.inventory import thp_check, thp_mode
    f = tmp_path / "enabled"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always" and thp_check(f) == (True, "transparent huge pages", f"always ({f})")
    f.write_text("always madvise [never]\n")
    ok, _, detail = thp_check(f)
    assert ok is None and detail.startswith("never (") and "docs/gpu.md" in detail
    assert thp_mode(tmp_path / "missing") is None and thp_check(tmp_path / "missing")[2].startswith("unknown (")
