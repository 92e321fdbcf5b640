"""The GPU stage of one rank: finding CUDA processes in /proc (a fake /proc tree here), refusals before anything
is locked, lock/checkpoint/restore/unlock in order, and rollback on every failure."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from slurmckpt.node import procfs
from slurmckpt.cuda.driver import GpuDriverError, ProcessState
from slurmckpt.cuda.fake import RESTORE_TID_OFFSET, FakeGpuDriver, fake_gpus
from slurmckpt.cuda.remap import GpuRemapError
from slurmckpt.errors import LockContended
from slurmckpt.cuda.procscan import (condition, find_cuda_pids, frozen_reason, inherited_device_majors, ns_pid,
                                     unsupported_reasons)
from slurmckpt.cuda.rank_stage import CudaRankGpu
from slurmckpt.cuda.stage import (GpuRollbackError, GpuStateError, GpuUnsupportedError, NullTreeGpuStage,
                                  TreeGpuStage)

CUDA_MAPS = ["/dev/nvidiactl", "/dev/nvidia0", "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"]


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def path(self) -> str:
        return str(self.root)

    def add(self, pid: int, *, cuda: bool = True, maps: list[str] = (), fds: list[str] = (),
            env: dict[str, str] | None = None, nspid: tuple[int, ...] | None = None, comm: str = "python3",
            uvm: list[int] = (), state: str = "S (sleeping)", cgroup: str = "0::/job\n",
            threads: dict[int, str] | None = None, raw_maps: list[str] = ()) -> int:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        paths = (CUDA_MAPS if cuda else []) + list(maps)
        lines = [f"7f00{i:04x}000-7f00{i:04x}fff rw-s 00000000 00:05 {i} {p}" for i, p in enumerate(paths)]
        uvm = list(uvm) or ([2 << 20] if cuda else [])        # every CUDA process: one 2 MiB uvm mapping
        lines += [f"{0x204a00000 + (i << 32):x}-{0x204a00000 + (i << 32) + n:x} rw-s 0 00:06 144 /dev/nvidia-uvm"
                  for i, n in enumerate(uvm)]
        lines += list(raw_maps)                 # whole lines: a file's device and inode chosen by the test
        (d / "maps").write_text("\n".join(lines + ["7fff0000-7fff1000 rw-p 00000000 00:00 0"]) + "\n")
        (d / "cgroup").write_text(cgroup)
        links = (["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1",
                  "/dev/nvidia-caps/nvidia-cap2"] if cuda else []) + list(fds) + ["/dev/null"]
        for i, link in enumerate(links):
            os.symlink(link, d / "fd" / str(i))
        (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
        (d / "status").write_text(f"Name:\t{comm}\nState:\t{state}\nNSpid:\t"
                                  + "\t".join(map(str, nspid or (pid,))) + "\n")
        (d / "comm").write_text(comm + "\n")
        (d / "stat").write_text(f"{pid} ({comm}) {state[0]} 1 " + "0 " * 20 + "\n")
        restore_thread = {pid + RESTORE_TID_OFFSET: "cuda-restore"} if cuda else {}   # the fake driver's tid
        for tid, name in {pid: comm, **restore_thread, **(threads or {})}.items():
            (d / "task" / str(tid)).mkdir(parents=True)
            (d / "task" / str(tid) / "comm").write_text(name + "\n")
        return pid


@pytest.fixture
def proc(tmp_path: Path):
    """A fake /proc that procfs.py reads for the whole test."""
    with procfs.rooted(tmp_path / "proc"):
        yield FakeProc(tmp_path / "proc")


@pytest.fixture
def driver() -> FakeGpuDriver:
    return FakeGpuDriver(fake_gpus(2), sleep=lambda s: None)


def stage_of(proc: FakeProc, driver: FakeGpuDriver, pids: list[int], **kw):
    return TreeGpuStage.for_tree(pids, driver_factory=lambda: driver, **kw)


# ---- finding CUDA processes and refusing unsupported ones ----

def test_a_jax_process_is_captured_like_any_other(proc, driver):
    """JAX was refused while its GPU state did not survive the in-place capture (H200, 2026-12-05); with the GPU
    restore run while the tree stays stopped it does (docs/gpu.md): a JAX process is locked like PyTorch's."""
    proc.add(40, maps=["/venv/lib/python3.12/site-packages/jaxlib/xla_extension.so"])
    driver.add_process(40)
    stage = stage_of(proc, driver, [40])
    assert isinstance(stage, TreeGpuStage) and stage.processes[0].restore_tid == 40 + RESTORE_TID_OFFSET
    stage.lock_all(100)
    assert driver.state(40) is ProcessState.LOCKED


DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
195 nvidia
234 nvidia-nvswitch
508 nvidia-uvm
509 nvidia-caps
510 nvidia-caps-imex-channels

Block devices:
195 nvidiafake
"""


def test_a_process_forked_from_a_cuda_process_is_dumped_with_its_device_maps_as_reservations(proc, driver):
    """A DataLoader-style worker forked after CUDA started maps /dev/nvidia* without a CUDA context (the driver
    says NO_CUDA): the stage checkpoints the CUDA process only, and the dump is told the node's NVIDIA majors
    so that criu keeps the worker's device mappings as reservations (it failed on them before, on the H200).
    A tree whose processes hold no device any more needs none."""
    proc.add(30)
    proc.add(31, cuda=False, maps=["/dev/nvidia-uvm"], comm="pt_data_worker")
    proc.add(32, cuda=False, fds=["/dev/nvidiactl"])
    for pid, cuda in ((30, True), (31, False), (32, False)):
        driver.add_process(pid, cuda=cuda)
    stage = stage_of(proc, driver, [30, 31, 32])
    assert [p.pid for p in stage.processes] == [30]
    assert isinstance(stage_of(proc, driver, [30, 32]), TreeGpuStage)
    (proc.root / "devices").write_text(DEVICES)
    assert inherited_device_majors([31, 32]) == [195, 234, 508, 509, 510]
    assert inherited_device_majors([]) == []


def test_char_device_majors_read_the_character_section_only():
    assert procfs.char_device_majors("nvidia", DEVICES) == [195, 234, 508, 509, 510]
    assert procfs.char_device_majors("nvidia", "Character devices:\n  1 mem\n") == []

def test_find_cuda_pids_by_scan_and_by_driver(proc, driver):
    proc.add(10, cuda=False)
    proc.add(11)
    proc.add(12, cuda=False, fds=["/dev/nvidia0"])      # holds an fd, no mapping: still a candidate
    proc.add(13)
    assert find_cuda_pids([10, 11, 12, 13, 14]) == [11, 12, 13]
    driver.add_process(11)
    driver.add_process(12, cuda=False)                  # opened the device, never initialised CUDA
    assert find_cuda_pids([10, 11, 12, 13], driver=driver) == [11]   # 13: gone (304)


def test_gpu_less_tree_gets_the_null_stage_without_loading_the_driver(proc):
    proc.add(20, cuda=False)

    def must_not_load():
        raise AssertionError("libcuda loaded for a GPU-less tree")
    stage = TreeGpuStage.for_tree([20], driver_factory=must_not_load)
    assert isinstance(stage, NullTreeGpuStage) and not stage.active
    stage.lock_all(100)
    stage.checkpoint_all()
    stage.restore_all()
    stage.unlock_all()
    assert stage.record() == {"processes": [], "gpus": [], "cuda_visible_devices": None}


@pytest.mark.parametrize("setup, cause", [
    (dict(env={"CUDA_VISIBLE_DEVICES": "MIG-1b2c3d4e-aaaa-bbbb-cccc-000000000000"}), "MIG"),
    (dict(fds=["/dev/nvidia-caps/nvidia-cap21"]), "MIG"),
    (dict(maps=["/dev/shm/cuda.shm.0.1a.1"]), "holds CUDA IPC state (/dev/shm/cuda.shm.0.1a.1)"),
    (dict(uvm=[2 << 20, 64 << 20]), "managed (UVM) memory (2 /dev/nvidia-uvm mappings, 66 MiB)"),
    (dict(maps=["/dev/shm/nccl-Xy12ab"]), "NCCL_SHM_DISABLE=1"),
    (dict(maps=["/opt/venv/nvidia/nccl/lib/libnccl.so.2"], env={"CUDA_VISIBLE_DEVICES": "0,1"},
          threads={31: "NCCL Progress 0"}),
     "runs NCCL (its thread 31 'NCCL Progress 0') with several GPUs or ranks on this node and without "
     "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0"),
    (dict(maps=["/x/libnccl.so.2"], env={"SLURM_STEP_TASKS_PER_NODE": "4(x2)", "NCCL_P2P_DISABLE": "1"},
          threads={32: "NCCL Service  0"}),
     "without NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0"),
])
def test_unsupported_setups_are_refused_before_any_lock(proc, driver, setup, cause):
    proc.add(30, **setup)
    driver.add_process(30)
    assert any(cause in r for r in unsupported_reasons([30]))
    with pytest.raises(GpuUnsupportedError, match=re.escape(cause)) as e:
        stage_of(proc, driver, [30])
    assert "pid 30" in str(e.value) and not e.value.retryable
    assert driver.calls == [] and driver.state(30) is ProcessState.RUNNING


def test_a_plain_cuda_process_is_not_refused(proc):
    proc.add(32)     # nvidia-cap1/cap2 fds, one uvm mapping, libnccl: what every torch process on driver 580 has
    proc.add(33, maps=["/x/nvidia/nccl/lib/libnccl.so.2"], env={"CUDA_VISIBLE_DEVICES": "0"})
    assert unsupported_reasons([32, 33]) == []


def test_mps_daemon_on_the_node_is_refused(proc, driver):
    proc.add(31)
    proc.add(5, cuda=False, comm="nvidia-cuda-mps-server")
    driver.add_process(31)
    with pytest.raises(GpuUnsupportedError, match="MPS daemon running \\(pid 5"):
        stage_of(proc, driver, [31])


def test_nccl_is_fine_when_configured_or_alone_on_the_node(proc):
    nccl = ["/x/libnccl.so.2"]
    proc.add(40, maps=nccl)                                            # one GPU, one rank: torch maps NCCL always
    proc.add(41, maps=nccl, env={"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                                 "NCCL_NVLS_ENABLE": "0"})
    proc.add(42, maps=nccl, env={"LOCAL_WORLD_SIZE": "8"}, threads={43: "NCCL Proxy"})
    proc.add(44, maps=nccl, env={"LOCAL_WORLD_SIZE": "8"})     # DDP over gloo: NCCL loaded, never started
    assert unsupported_reasons([40, 41, 44]) == []
    assert unsupported_reasons([42], nccl_env_required=False) == []
    assert len(unsupported_reasons([42])) == 1


def test_nccls_handle_socket_is_evidence_that_it_runs(proc, monkeypatch):
    from slurmckpt.cuda import procscan
    from slurmckpt.node.sock_diag import UnixSocket
    proc.add(45, maps=["/x/libnccl.so.2"], fds=["socket:[777]"], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    monkeypatch.setattr(procscan, "unix_sockets", lambda: {777: UnixSocket(777, 1, "@/tmp/nccl-socket-0-5a5a")})
    [reason] = unsupported_reasons([45])
    assert "runs NCCL (its socket @/tmp/nccl-socket-0-5a5a)" in reason


def test_process_already_locked_by_someone_else_is_refused(proc, driver):
    proc.add(50)
    driver.add_process(50, state=ProcessState.LOCKED)
    with pytest.raises(GpuStateError, match="already LOCKED"):
        stage_of(proc, driver, [50])
    assert driver.calls == []


@pytest.mark.parametrize("setup, files, why", [
    (dict(state="T (stopped)"), {}, "is stopped"),
    (dict(cgroup="0::/job/step\n"), {"job/step/cgroup.events": "populated 1\nfrozen 1\n"}, "frozen cgroup /job/step"),
    (dict(cgroup="0::/job\n"), {"job/cgroup.freeze": "1\n"}, "frozen cgroup /job"),
    (dict(cgroup="5:freezer:/slurm/uid_0/job_3\n0::/\n"), {"freezer/slurm/uid_0/job_3/freezer.state": "FROZEN\n"},
     "FROZEN freezer cgroup"),
])
def test_a_frozen_process_is_refused_before_any_driver_call(proc, driver, tmp_path, setup, files, why):
    cg = tmp_path / "cgroup"
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    proc.add(34, **setup)
    driver.add_process(34)
    assert why in frozen_reason(34, str(cg))
    with pytest.raises(GpuStateError, match="lock and checkpoint GPUs before freezing"):
        TreeGpuStage.for_tree([34], driver_factory=lambda: driver, cgroup_root=str(cg))
    assert driver.calls == []


def test_a_process_frozen_after_the_lock_is_not_touched(proc, driver, tmp_path):
    cg = tmp_path / "cgroup"
    (cg / "job").mkdir(parents=True)
    proc.add(35)
    driver.add_process(35)
    stage = TreeGpuStage.for_tree([35], driver_factory=lambda: driver, cgroup_root=str(cg))
    stage.lock_all(100)
    (cg / "job" / "cgroup.events").write_text("populated 1\nfrozen 1\n")     # frozen before the checkpoint
    with pytest.raises(GpuRollbackError) as e:
        stage.checkpoint_all()
    assert e.value.stuck == {35: "FROZEN"} and driver.calls == [("lock", 35)]
    (cg / "job" / "cgroup.events").write_text("populated 1\nfrozen 0\n")     # thawed: rollback can finish
    stage.rollback()
    assert driver.state(35) is ProcessState.RUNNING


# ---- the steps and their rollback ----

@pytest.fixture
def three(proc, driver):
    for pid in (61, 62, 63):
        proc.add(pid, env={"CUDA_VISIBLE_DEVICES": "1"}, nspid=(pid, pid - 60))
        driver.add_process(pid, gpus=[driver.devices()[1].uuid])
    return stage_of(proc, driver, [60, 61, 62, 63])


def states(driver, pids=(61, 62, 63)):
    return [driver.state(p) for p in pids]


def test_periodic_capture_phase_by_phase(three, driver):
    three.lock_all(100)
    assert states(driver) == [ProcessState.LOCKED] * 3
    three.checkpoint_all()
    rec = three.record()
    assert [p["pid"] for p in rec["processes"]] == [61, 62, 63] and rec["processes"][0]["ns_pid"] == 1
    assert rec["gpus"] == [driver.devices()[1].to_dict()] and rec["cuda_visible_devices"] == "1"
    three.restore_all()
    three.unlock_all()
    assert states(driver) == [ProcessState.RUNNING] * 3
    assert [op for op, _ in driver.calls] == ["lock"] * 3 + ["checkpoint"] * 3 + ["restore"] * 3 + ["unlock"] * 3
    assert sorted(pid for op, pid in driver.calls if op == "restore") == [61, 62, 63]    # at once


def test_lock_timeout_unlocks_the_ones_already_locked(three, driver):
    """A lock that times out on work in flight is LockContended (the one error a lock round retries), and
    whatever was already locked is unlocked."""
    driver.busy(62, 60.0)
    with pytest.raises(LockContended) as e:
        three.lock_all(100)
    assert e.value.retryable and e.value.context["pid"] == 62 and "CUDA_ERROR_NOT_READY" in str(e.value)
    assert isinstance(e.value.__cause__, GpuDriverError) and e.value.__cause__.timed_out
    assert states(driver) == [ProcessState.RUNNING] * 3
    assert ("unlock", 61) in driver.calls and ("lock", 63) not in driver.calls
    driver.busy(62, 0)                                 # the work ended: the stage is reusable
    three.lock_all(100)
    assert states(driver) == [ProcessState.LOCKED] * 3


def test_checkpoint_failure_restores_and_unlocks_everything(three, driver):
    three.lock_all(100)
    driver.fail_next("checkpoint", 63, 2)
    with pytest.raises(GpuDriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        three.checkpoint_all()
    assert states(driver) == [ProcessState.RUNNING] * 3
    assert ("restore", 61) in driver.calls and ("restore", 62) in driver.calls
    assert not any(p.locked or p.checkpointed for p in three.processes)


def test_restore_failure_after_a_periodic_capture_still_resumes_the_others(three, driver):
    three.lock_all(100)
    three.checkpoint_all()
    driver.fail_next("restore", 62)
    with pytest.raises(GpuDriverError, match="CUDA_ERROR_UNKNOWN"):
        three.restore_all()  # reported, after the rollback retried 62 (one-shot fault) and unlocked all
    assert states(driver) == [ProcessState.RUNNING] * 3
    # 61, 62 and 63 restored at once, then the rollback's retry of 62
    assert sorted(pid for op, pid in driver.calls if op == "restore") == [61, 62, 62, 63]


def test_rollback_that_fails_names_the_stuck_process(three, driver):
    three.lock_all(100)
    driver.fail_next("checkpoint", 62)
    driver.fail_next("unlock", 61)
    with pytest.raises(GpuRollbackError) as e:
        three.checkpoint_all()
    assert e.value.stuck == {61: "LOCKED"} and "pid 61 LOCKED" in str(e.value)
    assert isinstance(e.value.__cause__, GpuDriverError) and e.value.__cause__.pid == 62
    assert states(driver)[1:] == [ProcessState.RUNNING] * 2
    assert "GPU checkpoint of pid 62 failed (" in str(e.value)     # the first failure, not only the rollback's


def test_a_process_whose_gpu_state_the_driver_dropped_is_named_as_lost(three, driver):
    """A GPU restore that fails and leaves the driver reporting NO_CUDA (seen with JAX on the H200): the error
    names the restore as the first failure and says the process's GPU state is lost."""
    three.lock_all(100)
    three.checkpoint_all()
    driver.fail_next("restore", 62)
    driver.add_process(62, cuda=False)          # what the driver reports once the failed restore dropped it
    with pytest.raises(GpuRollbackError) as e:
        three.restore_all()
    assert e.value.stuck == {62: "NO_CUDA"}
    assert "GPU restore of pid 62 failed (" in str(e.value)
    assert "pid 62 NO_CUDA (its GPU state is lost)" in str(e.value)


def test_checkpoint_before_lock_is_refused(three, driver):
    with pytest.raises(GpuStateError):
        three.checkpoint_all()
    assert driver.calls == []


def test_unlock_all_is_idempotent(three, driver):
    three.unlock_all()
    three.lock_all(100)
    three.unlock_all()
    three.unlock_all()
    assert [op for op, _ in driver.calls].count("unlock") == 3


# ---- restore side ----

def test_adopt_restored_maps_namespace_pids_and_restores_the_checkpointed_processes(three, driver, proc):
    three.lock_all(100)
    three.checkpoint_all()
    record = three.record()
    for old in (61, 62, 63):                           # CRIU restore: same namespace pids, new host pids
        driver.remove_process(old)
    for new, ns in ((93, 3), (91, 1), (92, 2)):
        proc.add(new, nspid=(new, ns))
        driver.add_process(new, gpus=[driver.devices()[1].uuid], state=ProcessState.CHECKPOINTED)
    driver.stopped = {91, 92, 93}                      # criu restored them stopped
    restored = TreeGpuStage.adopt_restored(driver, record, [93, 91, 92], run_alone=driver.run_alone)
    assert restored.pids == [91, 92, 93]
    restored.restore_all([(driver.devices()[1].uuid, driver.devices()[0].uuid)])
    restored.unlock_all()
    done = [(op, pid) for op, pid in driver.calls if op in ("restore", "unlock")][-6:]
    assert sorted(done[:3]) == [("restore", 91), ("restore", 92), ("restore", 93)]      # at once
    assert done[3:] == [("unlock", 91), ("unlock", 92), ("unlock", 93)]                  # then in order
    assert set(driver.ran_alone) == {91 + RESTORE_TID_OFFSET, 92 + RESTORE_TID_OFFSET, 93 + RESTORE_TID_OFFSET}
    driver.stopped.clear()                             # let go (CudaRankGpu.restore)
    assert states(driver, (91, 92, 93)) == [ProcessState.RUNNING] * 3


def test_adopt_refuses_a_process_that_is_not_checkpointed(proc, driver):
    proc.add(70, nspid=(70, 1))
    driver.add_process(70)
    record = {"processes": [{"pid": 5, "ns_pid": 1, "initial": "RUNNING"}], "gpus": []}
    with pytest.raises(GpuStateError, match="is RUNNING, expected CHECKPOINTED"):
        TreeGpuStage.adopt_restored(driver, record, [70], run_alone=driver.run_alone)
    with pytest.raises(GpuStateError, match="no process with namespace pid 1"):
        TreeGpuStage.adopt_restored(driver, record, [], run_alone=driver.run_alone)


def test_a_restored_process_whose_gpu_state_cannot_be_read_is_described(proc, driver):
    """When the driver cannot answer for a restored process, the error says whether the process is gone or
    what state it and its threads are in, and how many NVIDIA fds it holds."""
    record = {"processes": [{"pid": 5, "ns_pid": 3, "initial": "RUNNING"}], "gpus": []}
    proc.add(71, nspid=(71, 3))                    # alive, but unknown to the driver
    with pytest.raises(GpuStateError) as e:
        TreeGpuStage.adopt_restored(driver, record, [71], run_alone=driver.run_alone)
    assert "restored process 71 has no GPU restore thread (CUDA_ERROR_OPERATING_SYSTEM)" in str(e.value)
    assert "process 71 (python3) state S, threads Sx1, 4 /dev/nvidia* fds" in str(e.value)
    assert condition(72) == "process 72 is gone"


def test_ns_pid_reads_the_innermost_namespace(proc):
    proc.add(80, nspid=(80, 17, 1))
    assert ns_pid(80) == 1


# ---- the rank tables' interface (CudaRankGpu) ----

def _rank_gpu(proc, driver, let_go=None):
    return CudaRankGpu(100, driver_factory=lambda: driver, context={"rank": 0}, run_alone=driver.run_alone,
                       let_go=let_go if let_go is not None else (lambda pids: None))


def test_rank_gpu_capture_resume_and_abort(proc, driver):
    proc.add(101, env={"CUDA_VISIBLE_DEVICES": "0"})
    driver.add_process(101)
    gpu = _rank_gpu(proc, driver)
    gpu.lock([100, 101])
    rec = gpu.checkpoint()
    assert rec["processes"][0]["pid"] == 101 and driver.state(101) is ProcessState.CHECKPOINTED
    gpu.resume()
    assert driver.state(101) is ProcessState.RUNNING
    gpu.lock([101])
    gpu.unlock()                                       # ABORT after PREPARE
    assert driver.state(101) is ProcessState.RUNNING
    gpu.lock([101])
    gpu.checkpoint()
    gpu.unlock()                                       # ABORT after CAPTURE's GPU checkpoint
    assert driver.state(101) is ProcessState.RUNNING


def test_rank_gpu_restore_remaps_onto_the_new_allocation(proc, driver):
    proc.add(110, env={"CUDA_VISIBLE_DEVICES": "0"}, nspid=(110, 1))
    driver.add_process(110, gpus=[driver.devices()[0].uuid])
    gpu = _rank_gpu(proc, driver)
    gpu.lock([110])
    rec = gpu.checkpoint()
    driver.remove_process(110)
    proc.add(120, env={"CUDA_VISIBLE_DEVICES": "0"}, nspid=(120, 1))   # old env, restored by CRIU
    driver.add_process(120, gpus=[driver.devices()[0].uuid], state=ProcessState.CHECKPOINTED)
    again = _rank_gpu(proc, driver)
    again.visible_devices = "1"                        # the requeued task got the other GPU
    again.restore(rec, [120])
    assert driver.restore_pairs[120] == [(driver.devices()[0].uuid, driver.devices()[1].uuid)]
    assert driver.state(120) is ProcessState.RUNNING
    again.restore(None, [120])                         # a GPU-less checkpoint: nothing to do


def test_rank_gpu_restore_refuses_incompatible_gpus(proc, driver):
    proc.add(130, env={"CUDA_VISIBLE_DEVICES": "0"}, nspid=(130, 1))
    driver.add_process(130, state=ProcessState.CHECKPOINTED)
    rec = {"processes": [{"pid": 9, "ns_pid": 1, "initial": "RUNNING"}],
           "gpus": [fake_gpus(1, name="NVIDIA H100 80GB HBM3")[0].to_dict()], "cuda_visible_devices": "0"}
    with pytest.raises(GpuRemapError, match="H100"):
        _rank_gpu(proc, driver).restore(rec, [130])
    assert driver.state(130) is ProcessState.CHECKPOINTED and ("restore", 130) not in driver.calls


def test_processes_are_checkpointed_and_restored_at_once_not_one_after_another(three, driver):
    """The driver copies several processes' memory faster together (docs/gpu.md, "Several GPU processes"):
    each call of the stage's checkpoint and restore is under way while the others are."""
    import threading
    started, release = [], threading.Event()
    real = {"checkpoint": driver.checkpoint, "restore": driver.restore}

    def slow(op):
        def call(pid, *args):
            started.append((op, pid))
            assert release.wait(5), f"{op} of {pid} ran alone: the others did not start beside it"
            return real[op](pid, *args)
        return call
    driver.checkpoint, driver.restore = slow("checkpoint"), slow("restore")
    threading.Timer(0.3, release.set).start()
    three.lock_all(100)
    three.checkpoint_all()
    assert sorted(started) == [("checkpoint", 61), ("checkpoint", 62), ("checkpoint", 63)]
    three.restore_all()
    three.unlock_all()
    assert states(driver) == [ProcessState.RUNNING] * 3


def test_a_process_that_ends_during_a_failed_checkpoint_is_not_killed(three, driver, proc):
    """A capture that meets a program tearing down its CUDA context (its exit): the driver's checkpoint fails with
    CUDA_ERROR_OPERATING_SYSTEM and it cannot read the state any more (seen on the H100 when a capture came at the
    end of a DataLoader job). The process then ends on its own: nothing is stuck, so the tree is not killed, and
    the error says the process ended during the capture. The others are rolled back as always."""
    import shutil
    three.lock_all(100)
    driver.fail_next("checkpoint", 62, 304)
    driver.remove_process(62)                    # the driver no longer knows its state

    def program_exits(seconds: float) -> None:
        shutil.rmtree(proc.root / "62", ignore_errors=True)
    three.sleep = program_exits
    with pytest.raises(GpuStateError, match=r"GPU checkpoint of pid 62 failed \(.*\): the process ended during"):
        three.checkpoint_all()
    assert three.ended == [62]
    assert states(driver, (61, 63)) == [ProcessState.RUNNING] * 2
    assert not any(p.locked or p.checkpointed for p in three.processes)


def test_a_process_whose_gpu_state_is_unreadable_and_that_runs_on_is_stuck(three, driver):
    """The same driver answer from a process that does not end within the grace time: its GPU state is in an
    unknown state, so it is named as left behind (the runner kills the tree)."""
    now = [0.0]
    three.clock = lambda: now[0]
    three.sleep = lambda s: now.__setitem__(0, now[0] + s)
    three.lock_all(100)
    driver.fail_next("checkpoint", 62, 304)
    driver.remove_process(62)
    with pytest.raises(GpuRollbackError) as e:
        three.checkpoint_all()
    assert e.value.stuck == {62: "UNKNOWN"} and three.ended == []
    assert now[0] >= three.exit_grace_s


def test_ended_tells_a_running_process_from_an_exited_one():
    """procfs.ended reads the kernel's PF_EXITING flag of every thread (real /proc): a running process has not
    ended; an exited child that is not reaped yet (a zombie, PF_EXITING set) and a pid that is gone have."""
    import subprocess
    import sys
    import time
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while procfs.stat(done.pid).state != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert procfs.stat(done.pid).state == "Z"
        assert procfs.stat(done.pid).flags & procfs.PF_EXITING
        assert procfs.ended(done.pid) and not procfs.ended(running.pid)
    finally:
        running.kill()
        running.wait()
        done.wait()
    assert procfs.ended(done.pid)



# ---- the GPU restore with the tree stopped ----

def _captured_and_left_stopped(proc, driver, let_go, tree=(101,)):
    """pid 101's GPU state checkpointed, then criu left the tree `tree` stopped (a periodic dump)."""
    proc.add(101, env={"CUDA_VISIBLE_DEVICES": "0"}, nspid=(101, 1))
    driver.add_process(101)
    gpu = _rank_gpu(proc, driver, let_go)
    gpu.lock([100, 101])
    gpu.checkpoint()
    assert gpu.stops_for_resume()
    gpu.left_stopped(list(tree))
    driver.stopped = {101}
    return gpu

def test_resume_after_a_dump_that_left_the_tree_stopped_runs_restore_threads_alone_then_lets_go(proc, driver):
    """criu left the tree stopped after a periodic dump: the GPU restore and unlock of each process go through
    its restore thread run alone (the fake driver fails any call on a stopped process otherwise, as the real one
    hangs), and only then are the processes criu stopped let go."""
    let_go: list[list[int]] = []
    gpu = _captured_and_left_stopped(proc, driver, let_go.append, tree=(101, 140))   # 140: CPU only
    gpu.resume()
    assert driver.ran_alone == [101 + RESTORE_TID_OFFSET] * 2      # restore, unlock
    assert let_go == [[101, 140]]
    driver.stopped.clear()
    assert driver.state(101) is ProcessState.RUNNING


def test_a_tree_whose_gpu_state_is_left_behind_stays_stopped(proc, driver):
    """A GPU restore that fails and cannot be rolled back (NO_CUDA: the state is lost): the processes are not let
    go; the runner kills the tree while it is still stopped."""
    let_go: list[list[int]] = []
    gpu = _captured_and_left_stopped(proc, driver, let_go.append)
    driver.fail_next("restore", 101)
    driver.add_process(101, cuda=False)
    with pytest.raises(GpuRollbackError):
        gpu.resume()
    assert let_go == []


def test_an_abort_after_a_dump_that_left_the_tree_stopped_lets_it_go_once_rolled_back(proc, driver):
    let_go: list[list[int]] = []
    gpu = _captured_and_left_stopped(proc, driver, let_go.append)
    gpu.unlock()                                       # the undo of the GPU lock (the abort's last)
    assert let_go == [[101]]
    driver.stopped.clear()
    assert driver.state(101) is ProcessState.RUNNING


def test_a_restored_tree_runs_again_only_after_its_gpu_state_is_back(proc, driver):
    """criu restored the tree stopped (every process in state T): GPU restore and unlock through the restore
    threads, then every stopped process of the tree is let go."""
    proc.add(150, env={"CUDA_VISIBLE_DEVICES": "0"}, nspid=(150, 1), state="T (stopped)")
    proc.add(151, cuda=False, nspid=(151, 2), state="T (stopped)")
    driver.add_process(150, gpus=[driver.devices()[0].uuid], state=ProcessState.CHECKPOINTED)
    driver.stopped = {150}
    rec = {"processes": [{"pid": 9, "ns_pid": 1, "initial": "RUNNING"}],
           "gpus": [driver.devices()[0].to_dict()], "cuda_visible_devices": "0"}
    let_go: list[list[int]] = []
    _rank_gpu(proc, driver, let_go.append).restore(rec, [150, 151])
    assert driver.ran_alone == [150 + RESTORE_TID_OFFSET] * 3     # state, restore, unlock
    assert let_go == [[150, 151]]


def test_a_stopped_process_that_was_exiting_is_let_go_to_end_and_not_killed(proc, driver):
    """A capture that met a program's exit, with the tree left stopped: the GPU restore fails and the driver can
    no longer read the process. Stopped, it could never end: it is let go, ends, and is not left behind."""
    import shutil

    def let_go(pids: list[int]) -> None:
        calls.append(pids)
        driver.stopped.difference_update(pids)
        shutil.rmtree(proc.root / "101", ignore_errors=True)        # it runs to its end
    calls: list[list[int]] = []
    gpu = _captured_and_left_stopped(proc, driver, let_go)
    driver.fail_next("restore", 101, 304)
    driver.remove_process(101)
    with pytest.raises(GpuStateError, match="the process ended during the capture"):
        gpu.resume()
    assert calls[0] == [101] and gpu.stage.ended == [101]


def test_a_restore_thread_that_is_not_the_processs_own_is_never_seized(proc, driver):
    """The restore thread's tid comes from the driver inside the user's process: one that is not a thread of
    that process (another user's, say) is refused before root seizes anything."""
    seized: list[int] = []
    gpu = _captured_and_left_stopped(proc, driver, lambda pids: None)
    gpu.stage.processes[0].restore_tid = 4242
    gpu.stage.run_alone = lambda tid: seized.append(tid)    # never reached
    with pytest.raises(GpuStateError, match="4242 is not a GPU restore thread of it"):
        gpu.stage._drv(gpu.stage.processes[0], lambda: None)
    assert seized == []
