"""The image store on the real cluster (docs/storage.md): a capture refused for space runs the job on and keeps
the previous commit; a persist that fails after the thaw leaves the epoch uncommitted and staging clean;
two nodes (network namespaces of the test cluster) committing to one job's store at once lose nothing;
`slurmckpt gc` removes a finished job's images and keeps a pending one's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.slurmjob import run, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
PYTHON = "/opt/slurmckpt/venv/bin/python"
CONFIG = Path("/etc/slurmckpt/slurmckpt.yaml")
WRITER = Path(__file__).parent / "workloads" / "store_writer.py"


def store_of(job_id: int):
    from slurmckpt.config import Config
    from slurmckpt.storage import JobStore, list_jobs
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
        kept = [line for line in original.splitlines() if line.split(":", 1)[0].strip() not in keys]
        CONFIG.write_text("\n".join(kept + [f"{k}: {json.dumps(v)}" for k, v in keys.items()]) + "\n")
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
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("q", 260)
    store = store_of(job.id)
    assert len(store.committed()) >= 1
    for e in store.committed():
        store.verify_rank(e["epoch"], "batch", 0, full=True)


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


def test_gc_removes_a_finished_jobs_images_and_keeps_a_held_ones() -> None:
    """A job that completed loses its images to `slurmckpt gc`; a job requeued and held (it will run again)
    keeps them, until it is cancelled."""
    wd = workdir(USER, "gc")
    script = "#!/bin/bash\npython3 zdtm.py --steps {} --sleep 0.2 --tag g --data data.txt\n"
    done = submit(USER, wd, script.format(80), "--checkpoint-interval=10s")
    held = submit(USER, wd, script.format(400), "--checkpoint-interval=10s")
    for job in (done, held):
        job.wait_output(r"committed \(interval\)", timeout=120)
    run("scontrol", "requeuehold", str(held.id))
    assert done.wait_done() == "COMPLETED"
    finished, waiting = store_of(done.id), store_of(held.id)
    listed = json.loads(run(CLI, "gc", "--dry-run", "--json").stdout)
    assert any(r["kind"] == "finished-job" and r["path"] == str(finished.job_dir) for r in listed)
    assert not any(r["path"] == str(waiting.job_dir) for r in listed)
    assert finished.job_dir.exists()
    run(CLI, "gc")
    assert not finished.job_dir.exists() and waiting.job_dir.exists() and waiting.committed()
    run("scancel", str(held.id))
    held.wait_for(lambda: held.state() in ("CANCELLED", "GONE"), "the held job cancelled", 60)
    run(CLI, "gc")
    assert not waiting.job_dir.exists()
