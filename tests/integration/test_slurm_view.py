"""Slurm's view of a checkpointed job stays true before and after a restore: `scontrol listpids` lists
every process of its workload, `sstat` MaxRSS and `sacct` TotalCPU count the workload, the workload sits in
the job's own memory and cpuset cgroups (so their limits hold; a job over its --mem is killed),
`scontrol suspend`/`resume` stop and continue it without disturbing checkpoints, and `scancel` ends every
process of it."""
from __future__ import annotations

import os
import re
import time

from tests.integration.slurmjob import Job, job_field, run, submit, task_cgroups, workdir

USER = "ckptuser1"
MEMHOG = "python3 memhog.py --mb 300 --steps {steps} --sleep 0.2\n"


def workload_pids(job: Job) -> set[int]:
    return {pid for cg in task_cgroups(job.id) for pid in cg.pids()}


def listpids(job: Job) -> set[int]:
    out = run("scontrol", "listpids", str(job.id), job_field(job.id, "NodeList") or "").stdout
    return {int(l.split()[0]) for l in out.splitlines()[1:] if l.split() and l.split()[0].isdigit()}


def max_rss_mb(job: Job) -> float:
    out = run("sstat", "-n", "-P", "-j", f"{job.id}.batch", "-o", "MaxRSS", check=False).stdout.strip()
    m = re.match(r"([\d.]+)([KMG]?)", out)
    assert m, f"sstat gave no MaxRSS: {out!r}"
    return float(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024, "": 1 / 2**20}[m.group(2)]


def v1_cgroup(pid: int, controller: str) -> str:
    for line in open(f"/proc/{pid}/cgroup"):
        _, ctrls, path = line.rstrip("\n").split(":", 2)
        if controller in ctrls.split(","):
            return path
    return ""


def check_slurm_sees_the_workload(job: Job, when: str) -> None:
    pids = workload_pids(job)
    assert pids, f"{when}: no workload processes"
    job.wait_for(lambda: pids <= listpids(job), f"{when}: listpids to list the workload {pids}", 30)
    job.wait_for(lambda: max_rss_mb(job) > 250, f"{when}: sstat MaxRSS to count the workload's 300 MiB", 60)
    for pid in pids:
        for controller in ("memory", "cpuset", "freezer"):
            path = v1_cgroup(pid, controller)
            assert re.search(rf"/job_{job.id}/step_batch", path), f"{when}: pid {pid} {controller}:{path}"


def step_of(job: Job) -> int:
    return max(int(m) for m in re.findall(r"memhog step (\d+)", job.text()) or ["-1"])


def test_slurm_tracks_accounts_and_limits_a_checkpointed_job_before_and_after_restore() -> None:
    wd = workdir(USER, "slurmview")
    job = submit(USER, wd, "#!/bin/bash\n" + MEMHOG.format(steps=400), "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    check_slurm_sees_the_workload(job, "before the restore")

    run("scontrol", "suspend", str(job.id))
    try:
        seen = []
        job.wait_for(lambda: seen.append(step_of(job)) or (len(seen) > 2 and seen[-1] == seen[-3]),
                     "the suspended workload to stop", 20)
        frozen_at = seen[-1]
        time.sleep(4)
        assert step_of(job) == frozen_at, "scontrol suspend did not stop the workload"
    finally:
        run("scontrol", "resume", str(job.id))
    job.wait_for(lambda: step_of(job) > frozen_at + 3, "the workload to continue after resume", 30)

    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    check_slurm_sees_the_workload(job, "after the restore")
    pids = workload_pids(job)
    # The restored processes start their CPU clocks at zero: once they have burnt 8 s, sacct must count them.
    job.wait_for(lambda: cpu_seconds(pids) >= 8, "the restored workload to burn 8 s of CPU", 120)
    restored_cpu = cpu_seconds(pids)
    time.sleep(6)      # one JobAcctGatherFrequency=task=5 poll after the reading
    run("scancel", str(job.id))
    job.wait_for(lambda: job.state() in ("CANCELLED", "COMPLETED"), "the cancel", 60)
    time.sleep(2)
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"scancel left workload processes {alive}"
    cpu = run("sacct", "-n", "-P", "-j", f"{job.id}.batch", "-o", "TotalCPU").stdout.strip().splitlines()
    assert cpu and _seconds(cpu[-1]) >= 0.9 * restored_cpu, \
        f"sacct TotalCPU {cpu} does not count the restored workload's {restored_cpu:.1f} s of CPU"


def test_memory_limit_holds_for_a_restored_workload() -> None:
    """--mem=400M: the workload is requeued at its first checkpoint (step ~50), restored, and from step 100
    on grows by 50 MiB a step: Slurm's memory cgroup, which the restored tree is in, kills it."""
    wd = workdir(USER, "slurmview-mem")
    job = submit(USER, wd, "#!/bin/bash\npython3 memhog.py --mb 100 --steps 400 --sleep 0.2 --grow-after 100\n",
                 "--mem=400M", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    assert step_of(job) < 90, "the job got too far before the requeue"
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    pid = min(workload_pids(job))
    path = v1_cgroup(pid, "memory")
    assert re.search(rf"/job_{job.id}/", path), f"the restored tree left the job's memory cgroup: {path}"
    state = job.wait_done()
    assert state in ("OUT_OF_MEMORY", "FAILED"), f"the restored workload outgrew --mem=400M: {state}"
    assert "memhog PASS" not in job.text()
    assert 100 <= step_of(job) < 400


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU of these processes, from /proc (0 for any that is gone)."""
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _seconds(text: str) -> float:
    parts = text.split("-")[-1].split(":")
    return sum(float(x) * 60 ** i for i, x in enumerate(reversed(parts)))
