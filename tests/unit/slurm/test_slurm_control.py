"""slurm/control.py is the one place that runs Slurm's client tools: the command lines it builds, what it makes
of their answers and failures, and that no other module of src/ runs one itself."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fake_slurm import FakeSlurm, Ran
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.control import CliSlurm, JobEnded

SRC = Path(__file__).resolve().parents[3] / "src" / "slurmckpt"
TOOLS = ("scontrol", "squeue", "sacct", "scancel", "sbatch", "sinfo", "srun", "sstat")


def test_signal_batch_is_scancel_batch_and_a_refusal_is_an_error(monkeypatch):
    slurm = FakeSlurm().install(monkeypatch)
    CliSlurm().signal_batch(42, 38)
    assert slurm.calls == [["scancel", "--batch", "--signal=38", "42"]]
    FakeSlurm(scancel=Ran(1, "", "scancel: error: Access/permission denied")).install(monkeypatch)
    with pytest.raises(SlurmError, match="permission denied"):
        CliSlurm().signal_batch(42, 38)


@pytest.mark.parametrize("answer, ended", [
    ("slurm_update error: Job has already finished", True),
    ("slurm_update error: Job/step already completing or completed", True),
    ("slurm_update error: Unable to contact slurm controller (connect failure)", False)])
def test_an_update_of_an_ended_job_is_told_from_other_refusals(monkeypatch, answer, ended):
    slurm = FakeSlurm(scontrol=Ran(1, "", answer)).install(monkeypatch)
    with pytest.raises(SlurmError, match="neither AdminComment") as refused:
        CliSlurm().annotate(7, "slurmckpt: last checkpoint: epoch 3")
    assert isinstance(refused.value, JobEnded) == ended
    assert [c[:3] for c in slurm.calls] == [["scontrol", "update", "JobId=7"]] * 2   # Comment tried as before


@pytest.mark.parametrize("out, want", [("", None), ("7|\n", ""), ("7|sbatch --checkpoint-interval=5m j.sh\n",
                                                                 "sbatch --checkpoint-interval=5m j.sh")])
def test_submit_line_tells_no_record_from_no_line_yet(monkeypatch, out, want):
    FakeSlurm(sacct=out).install(monkeypatch)
    assert CliSlurm().submit_line(7) == want


def test_queue_cluster_name_and_node_addr(monkeypatch):
    slurm = FakeSlurm(squeue="7|u|RUNNING|node1\n8|u|PENDING|(Priority)\n",
                      scontrol=lambda cmd: ("ClusterName = ckpt\nControlMachine=x\n" if "config" in cmd else
                                            "NodeName=node2 Arch=x86_64\n   NodeAddr=10.0.0.2 NodeHostName=n2\n"))
    slurm.install(monkeypatch)
    assert CliSlurm().queue("%i|%u|%T|%R") == ["7|u|RUNNING|node1", "8|u|PENDING|(Priority)"]
    CliSlurm().queue("%i", 8)
    assert slurm.ran("squeue") == [["squeue", "-h", "-o", "%i|%u|%T|%R"], ["squeue", "-h", "-o", "%i", "-j", "8"]]
    assert CliSlurm().cluster_name() == "ckpt"
    assert CliSlurm().node_addr("node2") == "10.0.0.2"
    assert ["scontrol", "show", "node", "node2"] in slurm.calls


def test_no_module_but_control_runs_a_slurm_tool():
    """A module that runs programs itself (subprocess, os.exec*/spawn*) names no Slurm tool: a Slurm command
    line anywhere but control.py would be a second place that talks to Slurm, with its own timeouts and
    error handling. (slurm/jobref.py builds command lines for the runner CliSlurm hands it.)"""
    runs = re.compile(r"^\s*(import subprocess|from subprocess import)|\bos\.(exec|spawn|posix_spawn)", re.M)
    tool = re.compile(r"""["'](%s)["']""" % "|".join(TOOLS))
    found = [f"{p.relative_to(SRC)}: {m.group(0)}" for p in sorted(SRC.rglob("*.py"))
             if p.name != "control.py" and runs.search(p.read_text()) for m in tool.finditer(p.read_text())]
    assert found == []


def test_comments_are_json_fields_a_users_comment_cannot_forge(monkeypatch):
    """`scontrol show job` prints a Comment holding a newline as two lines: `sbatch --comment=$'x\\n
    AdminComment=slurmckpt: forged'` would have made the second one read as the job's AdminComment."""
    import json
    forged = "x\nAdminComment=slurmckpt: forged"
    job = {"job_id": 9, "admin_comment": "site: y slurmckpt: last checkpoint: epoch 2", "comment": forged}
    slurm = FakeSlurm(squeue=json.dumps({"errors": [], "jobs": [job]})).install(monkeypatch)
    assert CliSlurm().comments(9) == {"AdminComment": "site: y slurmckpt: last checkpoint: epoch 2",
                                      "Comment": forged}
    assert not slurm.ran("scontrol")
    records = {"errors": [], "jobs": [{"job_id": 9, "comment": {"administrator": "old", "job": None}},
                                      {"job_id": 9, "comment": {"administrator": None, "job": forged}}]}
    FakeSlurm(squeue=Ran(1, "", "slurm_load_jobs error: Invalid job id specified"),
              sacct=json.dumps(records)).install(monkeypatch)
    assert CliSlurm().comments(9) == {"Comment": forged}        # accounting's last record of the job
