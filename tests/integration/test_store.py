"""The image store on the real cluster (docs/storage.md): a capture refused for space runs the job on and keeps
the previous commit; a persist that fails after the thaw leaves the epoch uncommitted and staging clean;
two nodes (network namespaces of the test cluster) committing to one job's store at once lose nothing;
a finished job's images go at its end (the job epilog), a requeued job's stay, and `slurmckpt gc` removes
what no epilog saw."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.slurmjob import AGENT_LOGS, job_field, run, submit, with_keys, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
PYTHON = "/opt/slurmckpt/venv/bin/python"
CONFIG = Path("/etc/slurmckpt/slurmckpt.yaml")
WRITER = Path(__file__).parent / "workloads" / "store_writer.py"


def store_of(job_id: int):
    from slurmckpt.config import Config
    from slurmckpt.store.jobstore import JobStore, list_jobs
    root = Path(Config.load().storage_root)
    cluster = next(c for c, j in list_jobs(root) if j == job_id)
    return JobStore(root, cluster, job_id)


GLUSTER_BRICK = Path("/var/lib/slurmckpt-cluster/gluster/brick")   # scripts/glusterfs.sh


def backing_path(path: Path) -> Path:
    """Where the server keeps `path` of the store: on the GlusterFS volume, the brick's copy (a file system
    that takes `chattr`); in a plain local store, the path itself."""
    from slurmckpt.config import Config
    root = Path(Config.load().storage_root)
    fstype = subprocess.run(["findmnt", "-rno", "FSTYPE", "--mountpoint", str(root)], capture_output=True,
                            text=True).stdout.strip()
    return GLUSTER_BRICK / path.relative_to(root) if fstype.startswith("fuse.glusterfs") else path


@pytest.fixture
def config_keys():
    """Agents started while active read these keys from the admin config too."""
    original = CONFIG.read_text()

    def set_keys(**keys: object) -> None:     # replaces a key the admin config already has
        CONFIG.write_text(with_keys(original, **keys))
    yield set_keys
    CONFIG.write_text(original)


def test_capture_over_quota_is_refused_job_runs_on_and_restores_the_previous_commit(config_keys) -> None:
    """Epoch 1 commits; the job is requeued under quota_job 1 KiB: every later capture is refused in PREPARE
    with a message naming quota_job, nothing is frozen, the job runs on from the restored epoch and its
    output equals an uninterrupted run's."""
    wd = workdir(USER, "quota")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 260 --sleep 0.2 --tag q --data data.txt\n",
                 "--checkpoint-interval=10s", "--open-mode=append")
    job.wait_output(r"committed \(interval\)", timeout=120)
    config_keys(quota_job=1024)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    job.wait_output(r"ABORTED \(rank [^,]+, node [^,]+, stage space\): .*capture refused: job \d+'s images would take .* over quota_job",
                    timeout=120)
    # while the job runs: once it has completed, its end removes its images (test_job_end.py)
    store = store_of(job.id)
    assert len(store.committed()) >= 1
    for e in store.committed():
        store.verify_rank(e["epoch"], "batch", 0, full=True)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("q", 260)


def test_persist_failure_after_the_thaw_leaves_the_epoch_uncommitted(config_keys) -> None:
    """The store refuses the rank's images while it persists (its epoch directory made immutable on the
    server during a pause after the dump): the epoch aborts at persist, the tree was already thawed and runs on, staging is
    cleaned, the previous commit stays and restores after a requeue."""
    wd = workdir(USER, "persistfail")
    config_keys(debug_stall_after="snapshot-output:10")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 400 --sleep 0.2 --tag p --data data.txt\n",
                 "--checkpoint-interval=30m", "--open-mode=append")
    job.wait_output(r"(?m)^p step 5 ", timeout=120)
    run(CLI, "checkpoint", str(job.id), user=USER)
    job.wait_output(r"committed \(manual\)", timeout=120)
    store = store_of(job.id)
    committed = {e["epoch"] for e in store.committed()}
    run(CLI, "checkpoint", str(job.id), user=USER)
    deadline = time.monotonic() + 60
    while not (open_epochs := [p for p in store.job_dir.glob("epoch-*") if int(p.name[6:]) not in committed]):
        assert time.monotonic() < deadline, "the second capture never allocated its epoch"
        time.sleep(0.2)
    while not (open_epochs[0] / ".lease").exists():       # allocated (the allocation writes its lease)
        assert time.monotonic() < deadline, "the second capture never finished allocating its epoch"
        time.sleep(0.2)
    time.sleep(1)       # inside the pause after the dump: the persist comes next
    frozen_dir = backing_path(open_epochs[0])     # the server refuses every write into it
    run("chattr", "+i", str(frozen_dir))
    try:
        # the first write the server refuses: a part of the images, or the rank's lease renewal beside them
        job.wait_output(r"ABORTED \(rank [^,]+, node [^,]+, stage persist\): .*(persisting .*|writing \.lease-\S+) "
                        r"failed: Operation not permitted", timeout=120)
    finally:
        run("chattr", "-i", str(frozen_dir))
    assert job.state() == "RUNNING"
    assert {e["epoch"] for e in store.committed()} == committed
    from slurmckpt.config import Config
    staging = Path(Config.load().staging_dir)
    time.sleep(2)
    assert not list(staging.glob(f"*.{job.id}/capture-*")), "staging not cleaned after the failed persist"
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines()[-1] == "p PASS steps=400 echoed=400"


def test_two_nodes_commit_to_one_store_at_once_and_lose_nothing() -> None:
    """A writer in node1's and one in node2's network namespace (their own steps of one job) allocate,
    persist and commit 10 epochs each into the cluster's storage_root at the same time: distinct numbers,
    each step keeps its 2 newest, every kept epoch verifies byte for byte."""
    from slurmckpt.config import Config
    root = Path(Config.load().storage_root)
    cluster = f"test-{os.getpid()}"
    procs = [subprocess.Popen(["ip", "netns", "exec", node, PYTHON, str(WRITER), str(root), cluster, step, "10"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node, step in (("node1", "1"), ("node2", "2"))]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        check = run(PYTHON, str(WRITER), str(root), cluster, "check", "0").stdout
        assert json.loads(check) == {"1.0": 2, "2.0": 2, "allocated": 20}
    finally:
        import shutil
        shutil.rmtree(root / cluster, ignore_errors=True)


def _job_end_said(job_id: int) -> str:
    """What `slurmckpt job-end` (started by the job epilog) logged for the job."""
    log = AGENT_LOGS / f"agent-{job_id}.end.0.log"
    return log.read_text() if log.exists() else ""


def test_a_finished_jobs_images_go_at_its_end_a_requeued_ones_stay_and_gc_takes_the_rest() -> None:
    """The job epilog's `slurmckpt job-end`: a job (on two nodes: two epilogs, one of which acts) requeued by
    `scontrol requeue` keeps its images through that run's end and restores from them; once it completes they
    are gone within a minute of its EndTime, without gc, and its summary says so. A job requeued and held keeps them too; cancelled while pending, it ends without an
    epilog, and `slurmckpt gc` (the timer's and cron's command) removes them."""
    from slurmckpt.store import summary
    from slurmckpt.config import Config
    wd = workdir(USER, "jobend")
    script = "#!/bin/bash\npython3 zdtm.py --steps {} --sleep 0.2 --tag {} --data {}.txt\n"
    done = submit(USER, wd, script.format(100, "e", "e"), "-N2", "--checkpoint-interval=10s")   # 2 epilogs
    held = submit(USER, wd, script.format(400, "h", "h"), "--checkpoint-interval=10s")
    for job in (done, held):
        job.wait_output(r"committed \(interval\)", timeout=120)
    run("scontrol", "requeue", str(done.id))
    run("scontrol", "requeuehold", str(held.id))
    for job in (done, held):            # their epilogs ran job-end, which waited for Slurm's final word
        job.wait_for(lambda job=job: "images kept: job " in _job_end_said(job.id), "job-end keeping the images", 60)
        assert store_of(job.id).committed()
    done.wait_output(r"restored from checkpoint epoch", timeout=180)
    finished = store_of(done.id)
    assert done.wait_done() == "COMPLETED"
    said = r"(?m)^(\S+ \S+),\d+ .*job end: removed .* of images: job COMPLETED$"       # logged once deleted
    done.wait_for(lambda: re.search(said, _job_end_said(done.id)), "its images removed at its end", 60)
    assert not finished.job_dir.exists()
    removed = re.search(said, _job_end_said(done.id))
    after = (datetime.fromisoformat(removed.group(1)) - datetime.fromisoformat(job_field(done.id, "EndTime"))).total_seconds()
    print(f"\ncompleted job's images removed {after:.0f}s after its EndTime")
    assert after < 60
    # one node of the two acted at each end: one line for the requeue, one for the end
    assert len(re.findall(r"job end: ", _job_end_said(done.id))) == 2, _job_end_said(done.id)
    assert done.app_lines() == expected_lines("e", 100)
    kept = summary.read(Config.load().summary_dir, finished.cluster, done.id)
    assert kept["epochs"] and kept["images_removed"]["why"] == "job COMPLETED", kept
    assert "images removed: " in run(CLI, "status", str(done.id), user=USER).stdout
    waiting = store_of(held.id)
    assert held.state() == "PENDING" and waiting.committed()
    run("scancel", str(held.id))
    held.wait_for(lambda: held.state() in ("CANCELLED", "GONE"), "the held job cancelled", 60)
    listed = json.loads(run(CLI, "gc", "--dry-run", "--json").stdout)
    assert any(r["kind"] == "finished-job" and r["path"] == str(waiting.job_dir) for r in listed), listed
    run(CLI, "gc")
    assert not waiting.job_dir.exists()
