"""`slurmckpt checkpoint` only signals jobs that run under slurmckpt: the capture signal ends any other."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

import slurmckpt.cli as cli
from fake_slurm import FakeSlurm, Ran
from slurmckpt.cli import interval_in
from slurmckpt.slurm import jobref

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


@pytest.mark.parametrize("interval, sent", [
    ("0s", False), ("00:00", False), ("0", False), ("off", False), ("OFF", False), ("0m", False),
    ("0:00:00", False), ("0h0m", False), ("0d0h0m0s", False), (None, False),
    ("1h 30m", False), ("5x", False),                   # the shim refuses these: no job runs with them
    ("10m", True), ("30s", True), ("00:10", True), ("1", True), ("1h30m", True),
])
def test_checkpoint_signals_only_a_job_whose_interval_is_on(monkeypatch, interval, sent):
    """0 in every spelling the shim accepts means off: such a job does not handle the capture signal, whose
    default action would end it, so nothing is sent; any interval above 0 gets the signal."""
    monkeypatch.setattr(os, "geteuid", lambda: 1001)
    monkeypatch.setattr(os, "getuid", lambda: 1001)
    monkeypatch.setattr(jobref, "resolve", lambda ref, run: jobref.JobInfo(7, 1001, ref))
    monkeypatch.setattr(cli, "submitted_interval", lambda job, wait_s=20.0: interval)
    slurm = FakeSlurm().install(monkeypatch)
    r = CliRunner().invoke(cli.cli, ["checkpoint", "7"])
    assert bool(slurm.ran("scancel")) is sent, r.output
    assert (r.exit_code == 0) is sent
    if not sent:
        assert "nothing was sent" in r.output
