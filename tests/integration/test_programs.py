"""Real programs from Debian's packages under slurmckpt, requeued mid-run and compared with an uninterrupted
run of the same program."""
from __future__ import annotations

import pytest

import pwd
import re
import sys
from pathlib import Path

from tests.integration.slurmjob import proctrack_delegate, run, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
MDRUN = "gmx -quiet mdrun -s md.tpr -deffnm {name} -nt 1 -reprod"


@pytest.mark.coverage(program="GROMACS gmx mdrun (water box, 1 thread, -reprod)", package="gromacs",
                       launcher="sbatch", nodes=1, proctrack="proctrack/linuxproc")
def test_gromacs_requeued_twice_ends_with_the_uninterrupted_final_structure() -> None:
    """GROMACS installs its own SIGTERM handler (it would stop early, "Received the TERM signal"). Under
    proctrack/linuxproc, which signals every process of the step, behind proctrack/slurmckpt: requeued
    twice mid-run, mdrun is never restarted and never sees Slurm's SIGTERM, and its final structure equals
    an uninterrupted run's bit for bit (-reprod, one thread)."""
    wd = workdir(USER, "gromacs")
    run("bash", "gromacs_water.sh", "80000", user=USER, cwd=wd, timeout=120)
    run("bash", "-c", MDRUN.format(name="ref"), user=USER, cwd=wd, timeout=600)
    with proctrack_delegate("proctrack/linuxproc"):
        job = submit(USER, wd, "#!/bin/bash\n" + MDRUN.format(name="run") + "\necho mdrun exit $?\n",
                     "--checkpoint-interval=10s")
        for restart in (1, 2):
            job.wait_output(r"committed \(interval\)", restart, timeout=180)
            assert "Finished mdrun" not in (wd / "run.log").read_text(), "mdrun ended before the requeue"
            job.requeue()
            job.wait_output(r"restored from checkpoint epoch", restart, timeout=240)
        assert job.wait_done(timeout=600) == "COMPLETED", job.text()
    log = (wd / "run.log").read_text()
    assert "Received the TERM signal" not in log and "Received the INT signal" not in log, log[-2000:]
    assert log.count("Started mdrun") == 1, "mdrun was restarted"
    assert "mdrun exit 0" in job.text()
    assert (wd / "run.gro").read_bytes() == (wd / "ref.gro").read_bytes(), "final structures differ"
    assert job.restarts() == 2


@pytest.mark.coverage(program="Python multiprocessing pool (2 workers) + numpy", package="python3-numpy",
                       launcher="sbatch", nodes=1)
def test_python_multiprocessing_pool_with_numpy_resumes_with_the_uninterrupted_result() -> None:
    """A multiprocessing pool (fork; pipes and POSIX semaphores between parent and 2 workers, per-worker numpy
    state) requeued twice mid-run: no round is lost or repeated, the pool is not restarted, and the final
    checksum equals an uninterrupted run's."""
    wd = workdir(USER, "mp-numpy")
    prog = "python3 mp_numpy.py --rounds 200 --workers 2 --sleep 0.2"
    ref = run("bash", "-c", prog.replace("--sleep 0.2", "--sleep 0"), user=USER, cwd=wd, timeout=120).stdout
    expected = re.search(r"mp_numpy result (\w+)", ref).group(1)
    job = submit(USER, wd, f"#!/bin/bash\n{prog}\necho pool exit $?\n", "-c2", "--checkpoint-interval=10s")
    for restart in (1, 2):
        job.wait_output(r"committed \(interval\)", restart, timeout=180)
        assert "mp_numpy result" not in job.text(), "the pool ended before the requeue"
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", restart, timeout=240)
    assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-2000:]
    rounds = [int(m.group(1)) for m in re.finditer(r"^mp_numpy round (\d+)$", job.text(), re.M)]
    assert rounds == list(range(200)), f"rounds not printed exactly once: {rounds[:5]}...{rounds[-5:]}"
    assert f"mp_numpy result {expected}" in job.text()
    assert "pool exit 0" in job.text()
    assert job.restarts() == 2


@pytest.mark.coverage(program="Python multiprocessing pool (2 {start} workers, semaphores in /dev/shm) + numpy",
                       package="python3-numpy", launcher="sbatch", nodes=1)
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_pool_with_dev_shm_semaphores_restores_after_they_were_removed(start: str) -> None:
    """A pool of workers started by spawn or forkserver (Python 3.14's default) shares named POSIX semaphores, files in the node's /dev/shm that
    the parent maps by a name glibc already removed. Requeued and held after the final capture, the job's
    /dev/shm files are deleted (as on another node or after a reboot): the restore puts them back, the
    pool runs on without a restart, and after a second requeue the final checksum equals an uninterrupted
    run's."""
    wd = workdir(USER, f"mp-{start}")
    prog = f"python3 mp_numpy.py --rounds 150 --workers 2 --sleep 0.2 --start {start}"
    ref = run("bash", "-c", prog.replace("--sleep 0.2", "--sleep 0"), user=USER, cwd=wd, timeout=120).stdout
    expected = re.search(r"mp_numpy result (\w+)", ref).group(1)
    job = submit(USER, wd, f"#!/bin/bash\n{prog}\necho pool exit $?\n", "-c2", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=180)
    uid = pwd.getpwnam(USER).pw_uid
    assert [f for f in Path("/dev/shm").glob("sem.*") if f.stat().st_uid == uid], "no semaphore in /dev/shm"
    run("scontrol", "requeuehold", str(job.id))          # final capture, then held
    job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
    gone = [f for f in Path("/dev/shm").iterdir() if f.stat().st_uid == uid]
    run("rm", "-f", *map(str, gone), user=USER)
    assert gone and not any(f.exists() for f in gone)
    run("scontrol", "release", str(job.id))
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    job.wait_output(r"committed \(interval\)", 2, timeout=180)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2, timeout=240)
    assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-2000:]
    rounds = [int(m.group(1)) for m in re.finditer(r"^mp_numpy round (\d+)$", job.text(), re.M)]
    assert rounds == list(range(150)), f"rounds not printed exactly once: {rounds[:5]}...{rounds[-5:]}"
    assert f"mp_numpy result {expected}" in job.text()
    assert "pool exit 0" in job.text()
    assert job.restarts() == 2
    assert not list(Path("/dev/shm").glob("link_remap.*")), "criu's temporary links were left in /dev/shm"


@pytest.mark.coverage(program="batch script running three srun steps (requeued in the second)",
                       package="slurm-client", launcher="sbatch + srun", nodes=1)
def test_batch_script_running_several_srun_steps_resumes_inside_the_second() -> None:
    """A batch script runs three srun steps one after another and is requeued while the second runs: the
    first step is not run again, the second continues where it was captured, the third runs once, and every
    step's output equals an uninterrupted run's."""
    wd = workdir(USER, "multi-steps")
    step = "srun -n1 python3 zdtm.py --tag {tag} --steps {n} --sleep 0.2 --data {tag}.txt\n"
    job = submit(USER, wd, "#!/bin/bash\necho preamble\n" + step.format(tag="s1", n=10) +
                 step.format(tag="s2", n=150) + step.format(tag="s3", n=10) + "echo epilogue\n",
                 "--checkpoint-interval=10s")
    job.wait_output(r"(?m)^s2 step 5 ", timeout=180)
    job.wait_for(lambda: len(re.findall(r"committed \(interval\)", job.text())) >= 1 and
                 re.search(r"^s2 step 20 ", job.text(), re.M) is not None, "a commit inside the second step", 180)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-2000:]
    assert job.app_lines() == ["preamble", *expected_lines("s1", 10), *expected_lines("s2", 150),
                               *expected_lines("s3", 10), "epilogue"], job.text()[-2000:]
    assert job.restarts() == 1
