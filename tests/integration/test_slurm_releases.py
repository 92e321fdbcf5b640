"""What Slurm releases after 24.11 change for a checkpointed job (docs/slurm-versions.md, "Slurm 25.11 and
26.05"): every run gets a new SLUID, which a restored program, whose environment is the captured run's, learns
through `slurmckpt env`; a job submitted with --requeue=expedite that fails is requeued (held, as no epilog
failed) and restores its last checkpoint when released; a job that namespace/linux runs in a user or PID
namespace of its own runs without checkpoints, saying which setting. Run on 26.05 only (TESTS_2605_ONLY)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


from tests.integration.slurmjob import Job, run, submit, workdir
from tests.integration.test_launch_form import slurm_version

USER = "ckptuser1"
REPO = Path(__file__).resolve().parents[2]
SLURM_CONF = Path("/etc/slurm/slurm.conf")
NAMESPACE_YAML = Path("/etc/slurm/namespace.yaml")      # next to slurm.conf, where namespace/linux reads it
SLURMD_LOGS = Path("/var/lib/slurmckpt-cluster/log")     # scripts/cluster.sh's LOG_DIR
NS_BASE = Path("/var/tmp/slurm-ns")                      # namespace.yaml's base_path: the jobs' private dirs
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


@contextmanager
def namespace_linux(flags: list[str]):
    """The cluster restarted with NamespaceType=namespace/linux (PrologFlags=Contain, which it needs) and
    namespace.yaml's clone_ns_flags (and CLONE_NEWNS, as namespace.yaml(5)'s example has it), then restarted
    as it was."""
    saved = SLURM_CONF.read_text()
    try:
        SLURM_CONF.write_text(saved + "\nNamespaceType=namespace/linux\nPrologFlags=Contain\n")
        NAMESPACE_YAML.write_text(f'---\ndefaults:\n  auto_base_path: true\n  base_path: "{NS_BASE}"\n'
                                  "  clone_ns_flags:\n" + "".join(f'    - "{f}"\n' for f in [*flags, "CLONE_NEWNS"]))
        subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), "restart"], check=True, timeout=180)
        yield
    finally:
        SLURM_CONF.write_text(saved)
        NAMESPACE_YAML.unlink(missing_ok=True)
        subprocess.run(["bash", str(REPO / "scripts/cluster.sh"), "restart"], check=True, timeout=180)
        shutil.rmtree(NS_BASE, ignore_errors=True)     # the jobs' directories (slurmd unmounted them)


def _submitted_through_slurms_namespace_setup(wd: Path, script: str, *options: str, attempts: int = 5) -> Job:
    """A job whose namespaces Slurm made. On this machine Slurm 26.05.5's own set-up of a job's namespaces
    fails for about one job in three ("_create_ns: ns mnt mount failed: Invalid argument" in slurmd's log,
    before any slurmckpt code runs; the job is then requeued and held): such a job is cancelled and another
    submitted; any other outcome is the test's."""
    for _ in range(attempts):
        job = submit(USER, wd, script, *options)
        failed = f"[{job.id}.extern] error: _create_ns: ns mnt mount failed"

        def setup_failed() -> bool:
            return any(failed in log.read_text(errors="replace") for log in SLURMD_LOGS.glob("slurmd*.log"))
        # the job's first output line (the wrapper's) comes after its namespaces were made, or never
        job.wait_for(lambda: setup_failed() or job.text() != "", "the job's first output", 90)
        if not setup_failed():
            return job
        run("scancel", str(job.id))
    raise AssertionError(f"Slurm failed to make {attempts} jobs' namespaces (slurmd's log: {failed})")


@pytest.mark.parametrize("flags, named", [(["CLONE_NEWUSER"], "a user"),
                                          (["CLONE_NEWUSER", "CLONE_NEWPID"], "a user and a PID")])
def test_a_job_in_namespace_linux_own_namespaces_runs_without_checkpoints_naming_the_setting(
        flags: list[str], named: str) -> None:
    """namespace/linux makes the job a user (and PID) namespace of its own, new every run: the agent refuses
    the job when its task starts, naming the setting; the program runs to its end uncheckpointed, nothing
    captured, and its output is an uninterrupted run's."""
    assert slurm_version() >= (25, 11, 0), "namespace/linux is Slurm 25.11's"
    wd = workdir(USER, "nslinux")
    with namespace_linux(flags):
        job = _submitted_through_slurms_namespace_setup(
            wd, "#!/bin/bash\npython3 zdtm.py --steps 40 --sleep 0.1 --tag ns --data data.txt\n",
            "--checkpoint-interval=10s")
        assert job.wait_done(timeout=90) == "COMPLETED", job.text()[-2000:]
    text = job.text()
    why = (f"the job runs in {named} namespace of its own (NamespaceType=namespace/linux with clone_ns_flags "
           f"{', '.join(flags)} in namespace.yaml)")
    assert why in text and "running the task without checkpoints" in text, text[:1500]
    assert "ns PASS steps=40" in text and "committed" not in text, text[-1500:]
