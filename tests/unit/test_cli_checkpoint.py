"""`slurmckpt checkpoint` only signals jobs that run under slurmckpt: the capture signal ends any other."""
from __future__ import annotations

import pytest

from fake_slurm import FakeSlurm, Ran
from slurmckpt.cli import interval_in

SCRIPT = "#!/bin/bash\n#SBATCH -n2\n#SBATCH --checkpoint-interval=10m\nsrun app\n"


@pytest.mark.parametrize("submit_line, script, want", [
    ("sbatch --checkpoint-interval=30m job.sh", "", "30m"),
    ("sbatch --checkpoint-interval 1h job.sh", "", "1h"),
    ("sbatch job.sh", SCRIPT, "10m"),
    ("sbatch --checkpoint-interval=off job.sh", SCRIPT, "off"),         # the command line wins
    ("sbatch job.sh", "#!/bin/bash\nsrun app\n", None),
    ("sbatch job.sh", "#!/bin/bash\necho hi\n#SBATCH --checkpoint-interval=5m\n", None),  # after a command
    ("", "", None),
])
def test_interval_in(submit_line, script, want):
    assert interval_in(submit_line, script) == want


def test_job_unknown_to_accounting_and_script_is_unknown_not_refused_as_plain(monkeypatch):
    """"unknown" (not "no interval") while accounting has no SubmitLine and the script names none."""
    import slurmckpt.cli as cli
    FakeSlurm().install(monkeypatch)
    assert cli.submitted_interval(7, wait_s=0) == "unknown"
    FakeSlurm(sacct="7|\n").install(monkeypatch)
    assert cli.submitted_interval(7, wait_s=0) == "unknown"         # a record whose SubmitLine is not in yet
    FakeSlurm(sacct=Ran(1, "", "slurmdbd down"), scontrol=Ran(1, "", "Invalid job id")).install(monkeypatch)
    assert cli.submitted_interval(7, wait_s=0) == "unknown"         # Slurm's errors: no answer, not "plain"
    FakeSlurm(sacct="7|sbatch job.sh\n", scontrol="#!/bin/bash\n").install(monkeypatch)
    assert cli.submitted_interval(7, wait_s=0) is None
    slurm = FakeSlurm(scontrol=SCRIPT).install(monkeypatch)
    assert cli.submitted_interval(7, wait_s=0) == "10m"
    assert slurm.ran("scontrol") == [["scontrol", "write", "batch_script", "7", "-"]]
    assert slurm.ran("sacct") == [["sacct", "-n", "-X", "-P", "-j", "7", "-o", "JobID,SubmitLine"]]
