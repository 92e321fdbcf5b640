"""The image store on a real shared file system that can fail: the test cluster's GlusterFS volume
(scripts/glusterfs.sh), mounted by every node with its own client. Its server (the brick process) is killed
while a periodic capture persists, and while a requeued job starts to restore: the job runs on, or waits for
the store and says so, and nothing committed is lost (the restored run's output equals an uninterrupted
run's)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.slurmjob import run, site_config, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
REPO = Path(__file__).resolve().parents[2]
LOGS = Path("/var/log/slurmckpt")


def storage(action: str) -> None:
    subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), f"storage-{action}"], check=True, timeout=120)


def zdtm(name: str, steps: int, *options: str):
    wd = workdir(USER, name)
    return submit(USER, wd, f"#!/bin/bash\npython3 zdtm.py --steps {steps} --sleep 0.2 --tag {name} --data d.txt\n",
                  *options)


def stalled_after_dump(job_id: int, epoch: int, timeout: float = 90) -> None:
    """Until the batch rank's agent pauses after the dump of `epoch` (debug_stall_after): the tree is frozen
    and dumped to node-local staging; its persist to the store comes after the thaw."""
    log = LOGS / f"agent-{job_id}.batch.0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and re.search(rf"pausing [\d.]+s after dump of epoch {epoch}\b", log.read_text()):
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id}: epoch {epoch} never paused after its dump")


def test_store_down_while_a_capture_persists_aborts_that_epoch_and_the_job_runs_on() -> None:
    """Epoch 1 commits. The brick dies while epoch 2 sits between its dump (to local staging) and its
    persist: the persist fails, epoch 2 is aborted with the store's error named, and the job runs on. Once
    the server is back later epochs commit again, and after a requeue the job restores the newest commit
    and ends with an uninterrupted run's output."""
    with site_config("debug_stall_after: dump:5\n"):     # read by the job's agents when they start
        job = zdtm("gluster-persist", 400, "-w", "node2", "--checkpoint-interval=10s")
        job.wait_output(r"committed \(interval\)", timeout=120)
    stalled_after_dump(job.id, 2)
    storage("down")
    try:
        job.wait_output(r"epoch 2 \(interval\) ABORTED .*(Transport endpoint is not connected|Input/output error)",
                        timeout=120)
        assert job.state() == "RUNNING"
    finally:
        storage("up")
    commits = len(re.findall(r"committed \(interval\)", job.text()))
    job.wait_output(r"committed \(interval\)", commits + 1, timeout=120)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    assert job.wait_done() == "COMPLETED", job.text()[-3000:]
    assert job.app_lines() == expected_lines("gluster-persist", 400)
    assert job.restarts() == 1


def test_store_down_while_a_requeued_job_starts_is_waited_for_and_the_job_restores() -> None:
    """The job is captured and held (requeuehold), the brick dies, the job is released: its agents wait for
    the store instead of starting the task from the beginning, the job's output says they waited, and once
    the server is back the job restores its commit and ends with an uninterrupted run's output."""
    job = zdtm("gluster-restore", 300, "-w", "node3", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    run("scontrol", "requeuehold", str(job.id))
    job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
    job.wait_output(r"(?:committed|captured) \(sigterm\)", timeout=60)
    storage("down")
    try:
        run("scontrol", "release", str(job.id))
        job.wait_for(lambda: job.state() == "RUNNING", "the released job to start", 120)
        time.sleep(12)                                    # the agents meet the dead store and wait
        assert "restored from checkpoint" not in job.text() and "starting from the beginning" not in job.text()
    finally:
        storage("up")
    job.wait_output(r"restored from checkpoint epoch", timeout=180)
    assert re.search(r"the image store did not answer for \d+s at the start \(its server was down\); waited",
                     job.text()), job.text()[-3000:]
    assert job.wait_done() == "COMPLETED", job.text()[-3000:]
    assert job.app_lines() == expected_lines("gluster-restore", 300)
    assert "starting from the beginning" not in job.text()
