"""The `slurmckpt` CLI against a live job (manual checkpoint, inspect, doctor) and a `--gres=gpu` job (fake
GPU devices in CI: the job's tree runs in its own PID and mount namespace like every GPU job, and is
restored)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.integration.slurmjob import run, submit, task_cgroups, workdir
from tests.support.pids import take

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
USER = "ckptuser1"


def test_doctor_passes_on_the_test_cluster() -> None:
    out = run(CLI, "doctor").stdout
    for check in ("criu version", "criu check", "plugstack.conf line", "SPANK plugin", "namespace init",
                  "image store", "job summaries for their users"):
        assert f"[ok] {check}" in out, out


def test_manual_checkpoint_then_inspect_then_requeue_via_cli() -> None:
    wd = workdir(USER, "cli")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 250 --sleep 0.2 --tag cli --data d.txt\n",
                 "--checkpoint-interval=30m")
    job.wait_output(r"cli step 10 ")
    run(CLI, "checkpoint", str(job.id), user=USER)
    job.wait_output(r"committed \(manual\)", timeout=60)
    shown = run(CLI, "inspect", str(job.id)).stdout
    assert "batch.0: image" in shown and "written file:" in shown and "d.txt" in shown, shown
    run(CLI, "checkpoint", "--requeue", str(job.id), user=USER)
    job.wait_output(r"(?:committed|captured) \(manual-requeue\)", timeout=60)
    job.wait_output(r"restored from checkpoint epoch", timeout=180)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("cli", 250)
    assert job.restarts() == 1


def started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if there is none."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def test_gres_gpu_job_has_its_own_proc_and_restores_while_its_old_host_pids_are_taken() -> None:
    """A task with a GPU (CUDA_VISIBLE_DEVICES) runs in its own PID namespace with its own /proc (a mount
    namespace of its own, which criu dumps and restores, Slurm's output file handed in as external).
    Requeued and held until every old host pid of its tree is held by another process, it is restored
    anyway, captured again, and its output equals an uninterrupted run's."""
    wd = workdir(USER, "gres")
    job = submit(USER, wd, "#!/bin/bash\necho \"gpus=$CUDA_VISIBLE_DEVICES\"\n"
                 "echo \"own /proc: shell pid $$, $(ls /proc | grep -c '^[0-9]') processes\"\n"
                 "python3 zdtm.py --steps 200 --sleep 0.2 --tag g --data d.txt\n",
                 "--gres=gpu:1", "-w", "node1", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    old = {pid: started(pid) for cg in task_cgroups(job.id) for pid in cg.pids()}
    assert len(old) >= 3, old           # init, the batch shell, python
    run("scontrol", "requeuehold", str(job.id))
    # gone: no process with that pid and start time (pid_max is 32768 here: another may reuse a pid at once)
    job.wait_for(lambda: job.state() == "PENDING" and all(started(p) != t for p, t in old.items()),
                 "the held job's old tree to be gone", 120)
    held = {pid: take(pid) for pid in old}
    sleepers = [s for s in held.values() if s is not None]
    try:
        # each old pid is held, by a sleep of ours or by whatever process reused it first
        free = [p for p, s in held.items() if s is None and started(p) is None]
        assert not free, f"could not take old host pid(s) {free}"
        run("scontrol", "release", str(job.id))
        job.wait_output(r"restored from checkpoint epoch")
        job.wait_output(r"committed \(interval\)", 1 + job.text().count("committed (interval)"), timeout=120)
        assert job.wait_done() == "COMPLETED"
        assert all(s.poll() is None for s in sleepers), "a sleep holding an old pid died"
    finally:
        for s in filter(None, sleepers):
            s.kill()
            s.wait()
    lines = job.app_lines()
    assert lines[0] == "gpus=0", lines[:2]
    m = re.fullmatch(r"own /proc: shell pid (\d+), (\d+) processes", lines[1])
    assert m and m.group(1) == "2" and int(m.group(2)) < 10, lines[1]       # the node has hundreds
    assert lines[2:] == expected_lines("g", 200)
    assert job.restarts() == 1


def test_checkpoint_of_a_job_not_under_slurmckpt_is_refused_and_the_job_lives() -> None:
    """The capture signal's default action ends a process: sent to a plain job it would kill it."""
    wd = workdir(USER, "cli-plain")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 40 --sleep 0.2 --tag plain --data d.txt\n")
    job.wait_output(r"plain step 5 ")
    p = run(CLI, "checkpoint", str(job.id), user=USER, check=False)
    assert p.returncode != 0 and "not submitted with --checkpoint-interval" in p.stderr, p.stderr
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("plain", 40)
