"""What a rank's capture will take and whether it fits, measured before anything is locked: host memory room
(MemAvailable, memory cgroup limits on v1 and v2, read from a fake /proc and cgroup tree), GPU bytes per
process from NVML (fake pynvml), refusals that name what does not fit by how much, notes on frameworks that
preallocate, and the restore's check of the target GPUs before criu runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from slurmckpt.node import procfs
from slurmckpt.node import host_memory
from slurmckpt.cuda import frameworks
from slurmckpt.cuda.fake import FakeGpuDriver, fake_gpus
from slurmckpt.cuda.fake_nvml import FakeNvml, FakeNvmlGpu
from slurmckpt.cuda.inventory import NvmlInventory, NvmlUnavailable
from slurmckpt.cuda.remap import GpuRemapError
from slurmckpt.cuda.rank_stage import CudaRankGpu
from slurmckpt.cuda.stage import GpuUnsupportedError
from slurmckpt.rank.fit import Footprint, measure, tree_memory
from slurmckpt.cuda.interface import GpuUse, NullGpu
from slurmckpt.node.host_memory import Headroom

GIB = 1 << 30
GPUS = fake_gpus(2)
A, B = GPUS[0].uuid, GPUS[1].uuid
CUDA_MAPS = ["/dev/nvidiactl", "/dev/nvidia0"]
JAX_MAPS = CUDA_MAPS + ["/opt/venv/lib/python3.12/site-packages/jaxlib/xla_extension.so"]


class Node:
    """A fake /proc (processes, meminfo, mountinfo) and a fake cgroup file system next to it."""

    def __init__(self, root: Path) -> None:
        self.proc, self.cg = root / "proc", root / "cgroup"
        (self.proc / "self").mkdir(parents=True)
        self.cg.mkdir()
        self.meminfo(512 * GIB)
        self.mounts(f"36 25 0:30 / {self.cg} rw,nosuid - cgroup2 cgroup2 rw")

    def meminfo(self, available: int) -> None:
        (self.proc / "meminfo").write_text(f"MemTotal:       {2048 * GIB // 1024} kB\n"
                                           f"MemAvailable:   {available // 1024} kB\nHugePages_Total:       0\n")

    def mounts(self, *lines: str) -> None:
        (self.proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")

    def process(self, pid: int, *, maps: list[str] = (), env: dict | None = None, anon_kb: int = 0,
                cgroup: str = "0::/job_7/step_0/user/task_0") -> int:
        d = self.proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "maps").write_text("".join(f"7f00{i:04x}000-7f00{i:04x}fff rw-s 00000000 00:05 {i} {p}\n"
                                        for i, p in enumerate(maps)))
        (d / "status").write_text(f"Name:\tpython3\nState:\tS (sleeping)\nNSpid:\t{pid}\nRssAnon:\t{anon_kb} kB\n"
                                  "RssShmem:\t1024 kB\nVmSwap:\t0 kB\n")
        (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
        (d / "cgroup").write_text(cgroup + "\n")
        return pid

    def limit(self, rel: str, files: dict[str, str]) -> None:
        d = self.cg / rel
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text + "\n")


@pytest.fixture
def node(tmp_path: Path):
    n = Node(tmp_path)
    with procfs.rooted(n.proc):
        yield n


def nvml_with(*uses: tuple[int, str, int], **gpu) -> FakeNvml:
    nvml = FakeNvml([FakeNvmlGpu(g.uuid, pci_bus_id=g.pci_bus_id, **gpu) for g in GPUS])
    for pid, uuid, n in uses:
        nvml.run(pid, uuid, n)
    return nvml


def rank_gpu(nvml: FakeNvml | None, driver: FakeGpuDriver | None = None) -> CudaRankGpu:
    def inventory():
        if nvml is None:
            raise NvmlUnavailable("pynvml is not installed")
        return NvmlInventory(nvml)
    return CudaRankGpu(100, driver_factory=lambda: driver or FakeGpuDriver(GPUS, sleep=lambda s: None),
                       inventory_factory=inventory, context={"rank": 0})


# ---- host memory ------------------------------------------------------------------------------------------
def test_the_tightest_v2_memory_limit_above_the_process_wins(node):
    pid = node.process(10)
    node.limit("job_7", {"memory.max": str(100 * GIB), "memory.current": str(30 * GIB),
                         "memory.stat": f"anon 1\nactive_file {2 * GIB}\ninactive_file {3 * GIB}"})
    node.limit("job_7/step_0", {"memory.max": "max", "memory.current": str(20 * GIB)})
    node.limit("job_7/step_0/user/task_0", {"memory.max": str(90 * GIB), "memory.current": str(20 * GIB)})
    room = host_memory.cgroup_headroom(pid)
    # job: 100 - 30 + 5 (page cache) = 75 GiB; task: 90 - 20 = 70 GiB
    assert (room.bytes, room.limit, room.cgroup, room.resident) == (70 * GIB, 90 * GIB, "/job_7/step_0/user/task_0",
                                                                    20 * GIB)
    assert [lv.cgroup for lv in host_memory.levels(pid)] == ["/job_7/step_0/user/task_0", "/job_7"]
    assert host_memory.node_available() == 512 * GIB


def test_v1_memory_controller_limits_count_and_unlimited_is_none(node):
    node.mounts(f"30 25 0:26 / {node.cg / 'memory'} rw,nosuid - cgroup cgroup rw,memory",
                f"36 25 0:30 / {node.cg / 'unified'} rw - cgroup2 cgroup2 rw")
    pid = node.process(10, cgroup="5:memory:/slurm/uid_1000/job_7/step_0\n0::/slurmckpt/7.0.0.0")
    node.limit("memory/slurm/uid_1000/job_7", {"memory.limit_in_bytes": str(64 * GIB),
                                               "memory.usage_in_bytes": str(10 * GIB),
                                               "memory.stat": f"cache 5\ntotal_inactive_file {GIB}"})
    node.limit("memory/slurm", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"})
    room = host_memory.cgroup_headroom(pid)
    assert (room.bytes, room.limit, room.cgroup) == (55 * GIB, 64 * GIB, "/slurm/uid_1000/job_7")
    free = node.process(11, cgroup="5:memory:/other")
    assert host_memory.cgroup_headroom(free) is None


def test_tree_memory_counts_anonymous_shared_and_swapped_pages(node):
    node.process(10, anon_kb=2 * 1024 * 1024)
    node.process(11, anon_kb=1024)
    assert tree_memory([10, 11, 12]) == 2 * GIB + (1 << 20) + 2 * (1 << 20)     # 12 is gone: 0


# ---- refusals ---------------------------------------------------------------------------------------------
def test_a_gpu_copy_larger_than_available_host_memory_is_refused_by_how_much():
    fp = Footprint(4 * GIB, GpuUse({10: {A: 108 * GIB}}), 100 * GIB, (), None)
    assert fp.refusals() == ["the GPU checkpoint copies 108.0 GiB of device memory (1 CUDA process(es)) into host "
                             "memory, but the node has 100.0 GiB available (MemAvailable): 8.0 GiB short"]


def test_a_gpu_copy_over_the_jobs_memory_limit_and_images_over_the_store_are_refused():
    fp = Footprint(4 * GIB, GpuUse({10: {A: 60 * GIB}, 11: {B: 20 * GIB}}), 500 * GIB,
                   (Headroom(50 * GIB, 64 * GIB, "/job_7", 14 * GIB),), 70 * GIB)
    cgroup, store = fp.refusals()
    assert "copy of 80.0 GiB of device memory (2 CUDA process(es)) into the job's host memory" in cgroup
    assert "memory cgroup /job_7 (limit 64.0 GiB) would need 94.0 GiB, 30.0 GiB more: the job's 14.0 GiB in use" in cgroup
    assert cgroup.startswith("the job's memory limit cannot hold the capture: ask Slurm for --mem=94G or more")
    assert store == ("the images take about 84.0 GiB (host 4.0 GiB + GPU 80.0 GiB), but the image store has "
                     "70.0 GiB free: 14.0 GiB short")
    assert fp.reply() == {"host_bytes": 4 * GIB, "gpu_bytes": 80 * GIB, "gpu_processes": 2,
                          "largest_process_bytes": 60 * GIB, "mem_available": 500 * GIB, "cgroup": "/job_7",
                          "cgroup_headroom": 50 * GIB}


def test_what_fits_is_not_refused():
    fits = Footprint(GIB, GpuUse({10: {A: 8 * GIB}}), 9 * GIB, (Headroom(8 * GIB, 9 * GIB, "/j", GIB),), 9 * GIB)
    assert fits.refusals() == []


def test_measure_takes_gpu_bytes_from_nvml_and_room_from_the_cuda_process_cgroup(node, tmp_path):
    node.process(10, anon_kb=1024)                                        # the shell: no GPU
    node.process(11, maps=CUDA_MAPS, anon_kb=4 * 1024 * 1024, cgroup="0::/job_7/step_0/user/task_0")
    node.limit("job_7", {"memory.max": str(64 * GIB), "memory.current": str(5 * GIB)})
    gpu = rank_gpu(nvml_with((11, A, 30 * GIB), (999, A, 50 * GIB)))   # 999: another job's process
    fp = measure([10, 11], gpu, tmp_path)
    assert fp.gpu.held == {11: {A: 30 * GIB}} and fp.gpu_bytes == 30 * GIB
    assert fp.host_bytes == 4 * GIB + (1 << 20) + 2 * (1 << 20)
    [level] = fp.levels
    assert (level.bytes, level.limit, level.cgroup) == (59 * GIB, 64 * GIB, "/job_7") and fp.refusals() == []
    assert fp.store_free is not None and fp.store_free > 0


def test_a_tree_without_nvidia_devices_never_touches_nvml(node, tmp_path):
    node.process(10, anon_kb=1024)
    fp = measure([10], rank_gpu(None), tmp_path)           # NVML "missing": not asked
    assert fp.gpu_bytes == 0 and fp.levels == () and fp.refusals() == []
    assert measure([10], NullGpu(), tmp_path).gpu == GpuUse()


def test_a_gpu_tree_without_pynvml_is_refused_with_what_to_install(node, tmp_path):
    node.process(11, maps=CUDA_MAPS)
    with pytest.raises(NvmlUnavailable, match="pynvml is not installed"):
        measure([11], rank_gpu(None), tmp_path)


def test_mig_seen_by_nvml_is_refused_before_anything_is_locked(node, tmp_path):
    node.process(11, maps=CUDA_MAPS)
    driver = FakeGpuDriver(GPUS, sleep=lambda s: None)
    with pytest.raises(GpuUnsupportedError, match="in MIG mode"):
        measure([11], rank_gpu(nvml_with((11, A, GIB), mig=1), driver), tmp_path)
    assert driver.calls == []


# ---- frameworks that preallocate --------------------------------------------------------------------------
def test_jax_default_preallocation_gets_a_note_naming_the_variable(node, tmp_path):
    node.process(11, maps=JAX_MAPS)
    node.process(12, maps=JAX_MAPS, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    total = GPUS[0].total_memory
    use = rank_gpu(nvml_with((11, A, int(total * 0.75)), (12, B, int(total * 0.75)))).footprint([11, 12])
    assert len(use.notes) == 1
    assert use.notes[0].startswith(f"pid 11 (JAX) holds 105.3 GiB (75% of the GPU's memory) on {A}: JAX's "
                                   "preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION=0.75)")
    assert "Set XLA_PYTHON_CLIENT_PREALLOCATE=false" in use.notes[0]


@pytest.mark.parametrize("maps, env, share, expect", [
    (JAX_MAPS, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, 0.5, "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"),
    (JAX_MAPS, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, 0.2, None),        # below its own fraction: in use
    (JAX_MAPS, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, 0.8, None),
    (CUDA_MAPS + ["/usr/lib/libtensorflow_framework.so.2"], {}, 0.95, "TF_FORCE_GPU_ALLOW_GROWTH=true"),
    (CUDA_MAPS + ["/usr/lib/libtensorflow_framework.so.2"], {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}, 0.95, None),
    (CUDA_MAPS + ["/x/torch/lib/libtorch_cuda.so"], {}, 0.6, "memory_reserved()"),
    (CUDA_MAPS + ["/x/torch/lib/libtorch_cuda.so"], {}, 0.3, None),
    (CUDA_MAPS, {}, 0.9, None),                                            # no framework known: nothing said
])
def test_preallocation_notes_by_framework_and_setting(node, maps, env, share, expect):
    node.process(11, maps=maps, env=env)
    total = GPUS[0].total_memory
    note = frameworks.preallocation_note(frameworks.GpuHolding(11, A, int(total * share), total),
                                         frameworks.framework_of(11), procfs.environ(11))
    assert (note is None) if expect is None else (expect in note)


def test_growth_defaults_leave_a_jobs_own_choice_alone():
    assert frameworks.growth_defaults({}) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                              "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    chosen = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9", "TF_GPU_ALLOCATOR": "cuda_malloc_async"}
    assert frameworks.growth_defaults(chosen) == {}


# ---- restore: the target GPUs, before criu ----------------------------------------------------------------
def record(device_bytes: dict[str, int]) -> dict:
    return {"processes": [{"pid": 11, "ns_pid": 11, "initial": "RUNNING"}], "gpus": [g.to_dict() for g in GPUS],
            "cuda_visible_devices": "0,1", "device_bytes": device_bytes}


def test_restore_refuses_gpus_without_room_for_the_checkpoint_naming_the_shortfall():
    nvml = nvml_with((500, B, 120 * GIB))               # someone else's process on the second GPU
    gpu = rank_gpu(nvml)
    gpu.check_restore(record({A: 100 * GIB, B: 10 * GIB}))       # 20 GiB free on B: fits
    with pytest.raises(GpuRemapError, match=r"GPU 1 \(.*\) has 19.8 GiB free \(120.6 GiB in use by other "
                                            r"processes\), the checkpoint holds 30.0 GiB on it: 10.2 GiB short"):
        gpu.check_restore(record({A: 100 * GIB, B: 30 * GIB}))


def test_restore_refuses_mig_and_prohibited_targets():
    from slurmckpt.cuda.fake_nvml import NVML_COMPUTEMODE_PROHIBITED
    with pytest.raises(GpuRemapError, match="is in MIG mode"):
        rank_gpu(nvml_with(mig=1)).check_restore(record({}))
    with pytest.raises(GpuRemapError, match="prohibits compute"):
        rank_gpu(nvml_with(compute_mode=NVML_COMPUTEMODE_PROHIBITED)).check_restore(record({}))


def test_restore_without_nvml_checks_chip_and_count_through_the_driver():
    gpu = rank_gpu(None)
    gpu.check_restore(record({A: 200 * GIB}))                       # no NVML: the bytes cannot be checked
    other = FakeGpuDriver(fake_gpus(2, name="NVIDIA A100-SXM4-80GB"), sleep=lambda s: None)
    with pytest.raises(GpuRemapError, match="chip 'NVIDIA A100-SXM4-80GB'"):
        rank_gpu(None, other).check_restore(record({}))
    rank_gpu(None).check_restore(None)                          # no GPU state: nothing to check


def test_a_checkpoint_records_what_each_gpu_held_for_the_restores_check(node):
    node.process(11, maps=CUDA_MAPS)
    driver = FakeGpuDriver(GPUS, sleep=lambda s: None)
    driver.add_process(11, gpus=[A, B])
    gpu = rank_gpu(nvml_with((11, A, 30 * GIB), (11, B, 2 * GIB), (12, B, 5 * GIB)), driver)
    gpu.footprint([11])
    gpu.lock([11])
    rec = gpu.checkpoint()
    assert rec["device_bytes"] == {A: 30 * GIB, B: 2 * GIB}          # 12 is not of this tree
    assert [p["pid"] for p in rec["processes"]] == [11]
    gpu.resume()
    assert driver.states()[11].name == "RUNNING"
