"""The coordinator's SIZE phase and abort reports, on the real Coordinator with real RankClient connections:
a capture that cannot fit is refused before any rank is asked to lock, phase timeouts follow the ranks'
bytes, and every abort names the rank, node, stage and reason, including an abort that did not complete."""
from __future__ import annotations

import threading
import time
from contextlib import closing

import pytest

from slurmckpt.coordinator import budget
from slurmckpt.errors import SlurmckptError
from slurmckpt.task.epochs import abort_message
from test_coordinator import Committer, FakeRank, Job, wait_for   # the same fakes as the coordinator's tests

GIB = 1 << 30


@pytest.fixture
def job():
    with closing(Job(Committer())) as j:
        yield j


def test_gpu_copies_that_do_not_fit_a_node_together_are_refused_before_any_lock(job):
    big = {"gpu_bytes": 100 * GIB, "gpu_processes": 1, "largest_process_bytes": 100 * GIB,
           "mem_available": 150 * GIB}
    ranks = [job.rank(f"0.{i}", node="gpu1", sized=big, gpus=True) for i in range(2)]
    res = job.epoch()
    assert res["status"] == "aborted" and res["stage"] == "size" and res["node"] == "gpu1", res
    assert res["rank"] == "0.0"
    assert res["error"] == ("capture refused before anything was locked: on node gpu1 the GPU checkpoints of ranks "
                            "0.0, 0.1 copy 200.0 GiB of device memory into host memory, the node has 150.0 GiB "
                            "available (MemAvailable): 50.0 GiB short")
    for r in ranks:
        wait_for(lambda r=r: "abort" in r.commands())
        assert "prepare" not in r.commands()
    assert res["gpu_bytes"] == 200 * GIB and not job.committer.calls


def test_a_rank_refusing_in_size_aborts_with_its_reason_and_nothing_is_locked(job):
    ok = job.rank("0.0", gpus=True)
    job.rank("0.1", fail="size")
    res = job.epoch()
    assert (res["status"], res["stage"], res["rank"], res["node"]) == ("aborted", "size", "0.1", "node-0.1")
    assert "size broke" in res["error"]
    wait_for(lambda: "abort" in ok.commands())
    assert "prepare" not in ok.commands()


def test_phase_timeouts_follow_the_bytes_with_the_config_as_floor(job):
    """A GPU checkpoint of 8 GB takes longer than a 0.3 s PREPARE floor: derived from the bytes, it commits.
    The same slow PREPARE with no bytes reported times out at the floor."""
    job.coord.prepare_timeout_s = 0.3
    sized = {"gpu_bytes": 8 * 10**9, "gpu_processes": 1, "largest_process_bytes": 8 * 10**9}
    r = job.rank("0.0", slow="prepare", sized=sized, gpus=True)
    res = job.epoch()
    assert res["status"] == "committed", res
    assert res["timeouts"]["prepare_s"] == pytest.approx(2 * (0.5 + 4.0) + 10)
    r.sized = {}
    res = job.epoch()
    assert res["status"] == "aborted" and res["stage"] == "prepare" and "within 0.3s" in res["error"]


def test_a_job_without_gpus_skips_size_and_one_gpu_rank_sizes_every_rank(job):
    """SIZE is for GPU copies: a CPU-only job keeps its three phases (and their latency); one rank with GPUs
    (its hello says so) makes every rank size, since they all dump to the same disks."""
    cpu = job.rank("0.0")
    assert job.epoch()["status"] == "committed" and "size" not in cpu.commands()
    gpu = job.rank("1.0", gpus=True)
    res = job.epoch()
    assert res["status"] == "committed" and ("size", 2) in cpu.got and ("size", 2) in gpu.got, res
    assert res["timeouts"] == {"prepare_s": 30.0, "capture_s": 600.0, "resume_s": 600.0}


def test_a_failing_stage_inside_a_phase_is_named(job):
    class Failing(FakeRank):
        def handle(self, kind, epoch, message=None):
            if kind == "prepare":
                self.got.append((kind, epoch))
                raise SlurmckptError("GPU checkpoint of pid 7 failed: CUDA_ERROR_OUT_OF_MEMORY", stage="gpu-checkpoint")
            return super().handle(kind, epoch, message)
    job.ranks.append(Failing(job, "0.0"))
    wait_for(lambda: "0.0" in job.coord.ranks)
    res = job.epoch()
    assert res["stage"] == "gpu-checkpoint" and "CUDA_ERROR_OUT_OF_MEMORY" in res["error"]


def test_an_abort_a_rank_could_not_complete_names_the_rank_and_why(job):
    job.rank("0.0", fail="prepare")
    job.rank("0.1", fail="abort")
    res = job.epoch()
    assert res["status"] == "aborted" and res["rank"] == "0.0"
    assert res["abort"] == "rank 0.1 (node node-0.1) could not undo its part: abort broke"


def test_an_abort_a_rank_never_confirms_is_reported_after_its_timeout(job, monkeypatch):
    monkeypatch.setattr(budget, "ABORT_FLOOR_S", 0.5)
    job.rank("0.0", fail="prepare")
    stuck = job.rank("0.1")
    release = threading.Event()
    stuck.client.handler = lambda kind, epoch, msg=None: (release.wait(10) if kind == "abort" else None) or {}
    t0 = time.monotonic()
    res = job.epoch()
    release.set()
    assert time.monotonic() - t0 < 5
    assert res["abort"].startswith("rank 0.1 (node node-0.1) did not confirm within 0.5s")


@pytest.mark.parametrize("result, line", [
    ({"epoch": 3, "rank": "0.1", "node": "gpu7", "stage": "prepare",
      "error": "no answer to prepare within 61.0s from rank 0.1 (node gpu7) (1 of 2 rank(s) answered)",
      "abort": "rank 0.1 (node gpu7) did not confirm within 120.0s (still busy)"},
     "checkpoint epoch 3 (interval) ABORTED (rank 0.1, node gpu7, stage prepare): no answer to prepare within 61.0s "
     "from rank 0.1 (node gpu7) (1 of 2 rank(s) answered); undoing it did not complete: rank 0.1 (node gpu7) did "
     "not confirm within 120.0s (still busy); the previous checkpoint stays the one restored"),
    ({"epoch": 4, "stage": "membership", "error": "rank(s) 0.1 not connected; nothing was frozen"},
     "checkpoint epoch 4 (interval) ABORTED (stage membership): rank(s) 0.1 not connected; nothing was frozen; the "
     "previous checkpoint stays the one restored"),
    ({"epoch": 5, "error": ""},
     "checkpoint epoch 5 (interval) ABORTED (no rank took part): no reason given; the previous checkpoint stays the "
     "one restored")])
def test_the_jobs_abort_line_names_rank_node_stage_reason_and_an_incomplete_undo(result, line):
    assert abort_message(result, "interval") == line
