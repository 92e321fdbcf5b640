"""CUDA IPC between a tree's processes (cuda/ipc_peers.py): named with both pids at the check stage, never as
MPS (an actor/learner pair sharing a CUDA tensor through torch.multiprocessing was refused as "an MPS client"
on the GPU machine, with no MPS server); MPS named only where an MPS daemon runs; from driver 610 on, the
processes of one cuda-checkpoint job captured one after another in one order (the fake driver hangs, as an
AssertionError, on any other order)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurmckpt.cuda import ipc_peers
from slurmckpt.cuda.driver import ProcessState
from slurmckpt.cuda.release import ipc_jobs, release, release_text
from slurmckpt.cuda.fake import FakeGpuDriver, fake_gpus
from slurmckpt.cuda.procscan import unsupported_reasons
from slurmckpt.cuda.rank_stage import CudaRankGpu
from slurmckpt.cuda.stage import TreeGpuStage, GpuUnsupportedError
from slurmckpt.node import procfs
from test_cuda_stage import FakeProc

R580, R610 = (580, 159, 4), (610, 57, 4)
JOB = {"CUDA_CHECKPOINT_JOB_FILE": "/proc/self/fd/5"}


def shm(inode: int, name: str = "/dev/shm/cuda.shm.0.2c.1") -> str:
    """A maps line of the CUDA runtime's IPC file `name`, inode `inode` on /dev/shm (device 00:1a)."""
    return f"7f10{inode:04x}0000-7f10{inode:04x}1000 rw-s 00000000 00:1a {inode} {name}"


@pytest.fixture
def proc(tmp_path: Path):
    with procfs.rooted(tmp_path / "proc"):
        yield FakeProc(tmp_path / "proc")


def pair(proc: FakeProc, learner_env=None, actor_env=None) -> tuple[int, int]:
    """A learner (exports a CUDA tensor) and an actor (maps it): torch.multiprocessing's spawn pair."""
    proc.add(71, comm="learner", raw_maps=[shm(9001)], env=learner_env)
    proc.add(72, comm="actor", raw_maps=[shm(9001)], env=actor_env)
    return 71, 72


def test_an_ipc_pair_is_named_as_cuda_ipc_with_both_pids_never_as_mps(proc):
    pair(proc)
    [reason] = unsupported_reasons([71, 72], release=R580)
    assert "pid 71 (learner) and pid 72 (actor) share GPU memory through CUDA IPC" in reason
    assert "driver 580.159.04 cannot checkpoint CUDA IPC; drivers from 610 on" in reason
    assert "MPS" not in reason


def test_the_check_stage_names_it_without_loading_libcuda_or_nvml(proc):
    pair(proc)

    def must_not_load():
        raise AssertionError("libcuda or NVML loaded by the check stage")
    gpu = CudaRankGpu(driver_factory=must_not_load, inventory_factory=must_not_load, release_of=lambda: R580)
    [reason] = gpu.refusals([71, 72])
    assert "pid 71 (learner) and pid 72 (actor)" in reason and "CUDA IPC" in reason


def test_a_mps_pipe_directory_without_an_mps_server_is_no_refusal(proc):
    proc.add(73, env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"})
    assert unsupported_reasons([73], release=R580) == []


def test_mps_is_named_where_an_mps_server_runs(proc):
    proc.add(74)
    proc.add(6, cuda=False, comm="nvidia-cuda-mps-server")
    [reason] = unsupported_reasons([74], release=R580)
    assert "MPS daemon running (pid 6" in reason


def test_the_same_file_name_is_not_the_same_share(proc):
    """Two processes each with a file of that name, not the same inode: no IPC between them; each holds IPC
    state no other process of the tree holds (its peer is elsewhere, or gone)."""
    proc.add(75, raw_maps=[shm(9101)])
    proc.add(76, raw_maps=[shm(9102)])
    assert [s.pids for s in ipc_peers.shares([75, 76])] == [(75,), (76,)]
    reasons = unsupported_reasons([75, 76], release=R580)
    assert len(reasons) == 2 and all("that no other process of this task's tree holds" in r for r in reasons)


def test_a_deleted_ipc_file_still_counts(proc):
    proc.add(77, raw_maps=[shm(9201) + " (deleted)"])
    proc.add(78, raw_maps=[shm(9201) + " (deleted)"])
    [share] = ipc_peers.shares([77, 78])
    assert share.pids == (77, 78) and share.path == "/dev/shm/cuda.shm.0.2c.1"


def test_driver_610_checkpoints_ipc_only_within_one_cuda_checkpoint_job(proc):
    pair(proc, learner_env=JOB)
    [reason] = unsupported_reasons([71, 72], release=R610)
    assert "only between processes started in one cuda-checkpoint job, and pid 72 (actor) started in none" \
        in reason
    assert not ipc_peers.job_members([71, 72], R610)


def test_driver_610_takes_an_ipc_pair_of_one_job(proc):
    pair(proc, learner_env=JOB, actor_env=JOB)
    assert unsupported_reasons([71, 72], release=R610) == []
    assert ipc_peers.job_members([71, 72], R610) and not ipc_peers.job_members([71, 72], R580)


def test_two_different_job_files_are_two_jobs(proc, tmp_path, monkeypatch):
    """Where the job file is still open, its inode tells which job (a memfd per `cuda-checkpoint
    --launch-job`)."""
    for pid, name in ((71, "a"), (72, "b")):
        target = tmp_path / f"memfd-{name}"
        target.write_text("job")
        proc.add(pid, raw_maps=[shm(9001)], env=JOB)
        (proc.root / str(pid) / "fd" / "5").symlink_to(target)
    real_link = procfs.fd_link
    monkeypatch.setattr(procfs, "fd_link", lambda pid, fd: "/memfd:cuda-checkpoint-job (deleted)" if fd == 5
                        else real_link(pid, fd))
    assert ipc_peers.job_of(71) != ipc_peers.job_of(72)
    assert ipc_peers.job_of(71).startswith("memfd:")
    [reason] = unsupported_reasons([71, 72], release=R610)
    assert "they were started in different ones" in reason


def test_the_release_is_read_from_sysfs(tmp_path):
    f = tmp_path / "version"
    f.write_text("580.159.04\n")
    assert release(str(f)) == R580 and release_text(R580) == "580.159.04" and not ipc_jobs(R580)
    f.write_text("610.57.04\n")
    assert ipc_jobs(release(str(f)))
    assert release(str(tmp_path / "none")) is None and not ipc_jobs(None) and release_text(None) == "unknown"


# ---- the GPU stage of one cuda-checkpoint job ----

@pytest.fixture
def job_pair(proc):
    pair(proc, learner_env=JOB, actor_env=JOB)
    driver = FakeGpuDriver(fake_gpus(1), sleep=lambda s: None, release=R610)
    for pid in (71, 72):
        driver.add_process(pid)
    driver.share_ipc([71, 72], job=True)
    return driver


def test_an_ipc_job_is_locked_whole_then_checkpointed_and_restored_one_by_one_in_order(proc, job_pair):
    stage = TreeGpuStage.for_tree([71, 72], driver_factory=lambda: job_pair, release_of=lambda: R610)
    assert isinstance(stage, TreeGpuStage) and stage.ipc_job and stage.record()["ipc_job"] is True
    stage.lock_all(100)
    stage.checkpoint_all()
    stage.restore_all()
    stage.unlock_all()
    assert [c for c in job_pair.calls if c[0] != "state"] == [
        ("lock", 71), ("lock", 72), ("checkpoint", 71), ("checkpoint", 72), ("restore", 71), ("restore", 72),
        ("unlock", 71), ("unlock", 72)]
    assert set(job_pair.states().values()) == {ProcessState.RUNNING}


def test_the_fake_driver_refuses_an_ipc_job_checkpointed_at_once(proc, job_pair):
    """What the stage must not do (and did before it knew of jobs): both members in the driver at once."""
    stage = TreeGpuStage.for_tree([71, 72], driver_factory=lambda: job_pair, release_of=lambda: R610)
    stage.ipc_job = False
    stage.lock_all(100)
    with pytest.raises(AssertionError, match="in the driver at once"):
        stage.checkpoint_all()


def test_an_ipc_job_restored_after_a_requeue_goes_in_the_order_it_was_captured(proc, job_pair):
    stage = TreeGpuStage.for_tree([71, 72], driver_factory=lambda: job_pair, release_of=lambda: R610)
    stage.lock_all(100)
    stage.checkpoint_all()
    record = stage.record()
    restored = TreeGpuStage.adopt_restored(job_pair, record, [71, 72], run_alone=job_pair.run_alone)
    assert restored.ipc_job
    job_pair.stopped = {71, 72}
    restored.restore_all(None)
    restored.unlock_all()
    assert [c[0] for c in job_pair.calls[-4:]] == ["restore", "restore", "unlock", "unlock"]
    assert [c[1] for c in job_pair.calls if c[0] == "restore"] == [71, 72]


def test_a_driver_that_does_not_take_ipc_jobs_is_refused_before_any_lock(proc, job_pair):
    job_pair.release = R580
    with pytest.raises(GpuUnsupportedError, match=re.escape("which this driver does not checkpoint")):
        TreeGpuStage.for_tree([71, 72], driver_factory=lambda: job_pair, release_of=lambda: R610)
    assert job_pair.calls == []


def test_driver_580_refuses_the_checkpoint_of_an_ipc_pair_and_the_stage_rolls_back(proc):
    """Where the /proc view misses the pair (an importer with no IPC file: tests/gpu/ipc_probe.py tells), the
    driver refuses at the checkpoint and the stage rolls everything back."""
    proc.add(81)
    proc.add(82)
    driver = FakeGpuDriver(fake_gpus(1), sleep=lambda s: None)
    for pid in (81, 82):
        driver.add_process(pid)
    driver.share_ipc([81, 82])
    stage = TreeGpuStage.for_tree([81, 82], driver_factory=lambda: driver, release_of=lambda: R580)
    stage.lock_all(100)
    with pytest.raises(Exception, match="CUDA_ERROR_NOT_SUPPORTED"):
        stage.checkpoint_all()
    assert set(driver.states().values()) == {ProcessState.RUNNING}
