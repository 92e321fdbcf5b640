"""What Slurm releases after 24.11 change for a checkpointed job (docs/slurm-versions.md, "Slurm 25.11 and
26.05"): every run gets a new SLUID, which a restored program, whose environment is the captured run's, learns
through `slurmckpt env`; a job submitted with --requeue=expedite that fails is requeued (held, as no epilog
failed) and restores its last checkpoint when released. (namespace/linux's own namespaces need cgroup v2, which
CI's machine lacks: their refusal is tests/unit/test_slurm_namespaces.py.) Run on 26.05 only (TESTS_2605_ONLY)."""
from __future__ import annotations

import json
import re

from tests.integration.slurmjob import Job, run, submit, workdir
from tests.integration.test_launch_form import slurm_version

USER = "ckptuser1"
# A loop that, once the test has made `go` (after the restore), compares its own environment with this run's.
ENV_PROBE = r'''
import json, os, subprocess, time
for i in range(1200):
    print("probe step", i, flush=True)
    if os.path.exists("go"):
        now = subprocess.run(["/usr/local/bin/slurmckpt", "env", "--json"], capture_output=True, text=True)
        own = {k: os.environ.get(k) for k in ("SLURM_RESTART_COUNT", "SLURM_JOB_SLUID")}
        print("probe own", json.dumps(own), flush=True)
        print("probe now", json.dumps(json.loads(now.stdout) if now.returncode == 0 else {"error": now.stderr}),
              flush=True)
        break
    time.sleep(0.25)
'''


def sluid(job: Job) -> str | None:
    """The SLUID of the job's current run (`scontrol show job -d`, 26.05 on), None before 26.05."""
    m = re.search(r"\bSLUID=(\S+)", run("scontrol", "-d", "show", "job", str(job.id)).stdout)
    return m.group(1) if m else None


def _line(job: Job, tag: str) -> dict:
    m = re.search(rf"^probe {tag} (.*)$", job.text(), re.M)
    assert m, f"no 'probe {tag}' line:\n{job.text()[-2000:]}"
    return json.loads(m.group(1))


def test_a_restored_program_reads_this_runs_slurm_variables_through_slurmckpt_env() -> None:
    """Captured in run 0 and restored in run 1: the program's own environment still says run 0 (no
    SLURM_RESTART_COUNT; 26.05: the first run's SLUID), `slurmckpt env` says run 1 (restart count 1; the SLUID
    Slurm shows for the job now, a new one)."""
    wd = workdir(USER, "runenv")
    (wd / "probe.py").write_text(ENV_PROBE)
    job = submit(USER, wd, "#!/bin/bash\nexec python3 probe.py\n", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    first = sluid(job)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    (wd / "go").write_text("")
    assert job.wait_done() == "COMPLETED", job.text()[-2000:]
    own, now = _line(job, "own"), _line(job, "now")
    assert own["SLURM_RESTART_COUNT"] in (None, "0") and now["SLURM_RESTART_COUNT"] == "1", (own, now)
    second = sluid(job)
    if slurm_version() >= (26, 5, 0):
        assert first and second and first != second, f"Slurm gave the runs SLUIDs {first} and {second}"
        assert own["SLURM_JOB_SLUID"] == first and now["SLURM_JOB_SLUID"] == second, (own, now, first, second)
        assert "`slurmckpt env` prints this run's" in job.text()
    else:
        assert second is None and "SLURM_JOB_SLUID" not in now


def test_an_expedited_requeue_after_a_failure_holds_the_job_and_the_release_restores_it() -> None:
    """Slurm 25.11+: `--requeue=expedite` requeues a run that exits non-zero; with no failed epilog (the
    failure was the program's) Slurm holds it. Released, it restores the checkpoint taken before the failure
    and ends as an uninterrupted run would."""
    assert slurm_version() >= (25, 11, 0), "expedited requeue is Slurm 25.11's"
    wd = workdir(USER, "expedite")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 120 --sleep 0.2 --tag exp --data data.txt "
                 "--exit-if fail\n", "--requeue=expedite", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    (wd / "fail").write_text("")
    # scontrol names the state REQUEUE_HOLD (PENDING with the REQUEUE_HOLD flag); its images stay (job end)
    job.wait_for(lambda: job.state() == "REQUEUE_HOLD" and job.restarts() == 1, "the expedited requeue, held", 120)
    (wd / "fail").unlink()
    run("scontrol", "release", str(job.id))
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    assert job.wait_done() == "COMPLETED", job.text()[-2000:]
    assert "exp PASS steps=120" in job.text()
