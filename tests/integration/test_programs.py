"""Real programs from Debian's packages under slurmckpt, requeued mid-run and compared with an uninterrupted
run of the same program."""
from __future__ import annotations

from tests.integration.slurmjob import proctrack_delegate, run, submit, workdir

USER = "ckptuser1"
MDRUN = "gmx -quiet mdrun -s md.tpr -deffnm {name} -nt 1 -reprod"


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
