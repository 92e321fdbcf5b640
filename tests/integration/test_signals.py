"""Slurm's kill sequence and a checkpointed program with its own SIGTERM handler: under proctrack/slurmckpt
delegating to proctrack/cgroup and to proctrack/linuxproc (which signals every process of the step), a
requeue's SIGTERM never reaches the program before the capture; the restored run ends with the result of
an uninterrupted run; a signal the user sends on purpose (`scancel --batch --signal=USR1`) still reaches
it."""
from __future__ import annotations

import re

import pytest

from tests.integration.slurmjob import proctrack_delegate, run, submit, workdir

USER = "ckptuser1"
TRAP = "python3 sigterm_trap.py --steps 150 --sleep 0.2"


def freezer_cgroup(pid: int) -> str:
    for line in open(f"/proc/{pid}/cgroup"):
        _, ctrls, path = line.rstrip("\n").split(":", 2)
        if "freezer" in ctrls.split(","):
            return path
    return ""


def workload_pid(job_id: int) -> int:
    out = run("pgrep", "-u", USER, "-f", "sigterm_trap.py --steps", check=False).stdout.split()
    pids = [int(p) for p in out if open(f"/proc/{p}/environ", "rb").read().find(
        f"SLURM_JOB_ID={job_id}\0".encode()) >= 0]
    assert pids, f"job {job_id}: no sigterm_trap process"
    return pids[0]


@pytest.mark.coverage(program="Python program with its own SIGTERM handler", package="python3",
                       launcher="sbatch", nodes=1)
@pytest.mark.parametrize("delegate", ["proctrack/cgroup", "proctrack/linuxproc"])
def test_requeue_sigterm_never_reaches_a_program_that_handles_it(delegate: str) -> None:
    wd = workdir(USER, "signals-" + delegate.split("/")[1])
    ref = run("bash", "-c", TRAP, user=USER, cwd=wd, timeout=120).stdout
    expected = re.search(r"result (\w+) usr1 0", ref).group(1)
    with proctrack_delegate(delegate):
        job = submit(USER, wd, "#!/bin/bash\nexec " + TRAP + "\n", "--checkpoint-interval=10s")
        job.wait_output(r"sigterm_trap step 5", timeout=120)
        tracked = re.search(rf"/job_{job.id}/", freezer_cgroup(workload_pid(job.id)))
        assert bool(tracked) == (delegate == "proctrack/cgroup"), \
            f"{delegate} is not the plugin tracking the step: freezer {freezer_cgroup(workload_pid(job.id))}"
        job.wait_output(r"committed \(interval\)", timeout=120)
        run("scancel", "--batch", "--signal=USR1", str(job.id))
        job.wait_output(r"sigterm_trap got USR1 \(1\)", timeout=30)
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", timeout=240)
        assert job.wait_done(timeout=240) == "COMPLETED", job.text()
    text = job.text()
    assert "caught SIGTERM" not in text, text[-1500:]
    assert re.search(rf"sigterm_trap result {expected} usr1 1\b", text), text[-1500:]
    assert job.restarts() == 1
