"""`slurmckpt checkpoint` only signals jobs that run under slurmckpt: the capture signal ends any other."""
from __future__ import annotations

import pytest

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


class Done:
    def __init__(self, stdout: str) -> None:
        self.stdout = stdout


def test_job_unknown_to_accounting_and_script_is_unknown_not_refused_as_plain(monkeypatch):
    import slurmckpt.cli as cli
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: Done(""))
    assert cli.submitted_interval(7, wait_s=0) == "unknown"
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: Done("7|\n" if cmd[0] == "sacct" else ""))
    assert cli.submitted_interval(7, wait_s=0) == "unknown"         # a record whose SubmitLine is not in yet
    monkeypatch.setattr(cli.subprocess, "run",
                        lambda cmd, **kw: Done("7|sbatch job.sh\n" if cmd[0] == "sacct" else "#!/bin/bash\n"))
    assert cli.submitted_interval(7, wait_s=0) is None
    monkeypatch.setattr(cli.subprocess, "run",
                        lambda cmd, **kw: Done("" if cmd[0] == "sacct" else SCRIPT))
    assert cli.submitted_interval(7, wait_s=0) == "10m"
