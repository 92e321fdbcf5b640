"""`slurmckpt checkpoint | requeue` only signal jobs that run under slurmckpt (the capture signal ends any
other), decide that fast (slurmctld first, never a wait for accounting), and say so like Slurm's tools."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fake_slurm import FakeSlurm, Ran, squeue_answer, squeue_line
from slurmckpt.cli import cli, lookup
from slurmckpt.cli.lookup import interval_in
from slurmckpt.config import Config

SCRIPT = "#!/bin/bash\n#SBATCH -n2\n#SBATCH --checkpoint-interval=10m\nsrun app\n"


@pytest.fixture
def site(tmp_path: Path, monkeypatch) -> Path:
    """A slurm.conf + plugstack.conf and a slurmckpt.yaml of our own (SLURM_CONF, SLURMCKPT_CONFIG)."""
    (tmp_path / "slurm.conf").write_text(f"ClusterName=c\nPlugStackConfig={tmp_path}/plugstack.conf\n")
    (tmp_path / "plugstack.conf").write_text("required /x/slurmckpt_spank.so wrapper=/w agent=/a\n")
    (tmp_path / "slurmckpt.yaml").write_text(f"summary_dir: {tmp_path}/summaries\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    monkeypatch.setattr(os, "geteuid", lambda: 1001)
    monkeypatch.setattr(os, "getuid", lambda: 1001)
    lookup.cluster.cache_clear()
    return tmp_path


def _fake(**answers) -> FakeSlurm:
    answers.setdefault("squeue", squeue_answer(squeue_line(7)))
    answers.setdefault("scontrol", lambda cmd: "ClusterName = c\n" if cmd[1:3] == ["show", "config"] else "")
    return FakeSlurm(**answers)


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


@pytest.mark.system
def test_the_run_record_says_the_batch_step_is_wrapped_and_nothing_else_is_asked(site, monkeypatch):
    """A summary the user may read whose run record is of the job's current run (restart count): the batch
    wrapper handles the signal; accounting and the script are not asked."""
    summaries = site / "summaries" / "c"
    summaries.mkdir(parents=True)
    (summaries / "7.json").write_text(json.dumps({"cluster": "c", "job": 7, "run": {"restart_count": 2, "interval_s": 600}}))
    slurm = _fake(squeue=squeue_answer(squeue_line(7, restarts=2))).install(monkeypatch)
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 0, r.output
    assert [c[0] for c in slurm.calls if c[0] != "scontrol"] == ["squeue", "scancel"]
    assert slurm.ran("scancel") == [["scancel", "--batch", f"--signal={int(lookup_signal())}", "7"]]
    (summaries / "7.json").write_text(json.dumps({"cluster": "c", "job": 7,
                                                  "run": {"restart_count": 2, "disabled": "not in debug"}}))
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 1 and "disabled" in r.output and "nothing was sent" in r.output


def lookup_signal():
    from slurmckpt.task.schedule import CHECKPOINT_SIGNAL
    return CHECKPOINT_SIGNAL


def test_a_job_enabled_by_the_plugins_default_interval_is_accepted(site, monkeypatch):
    """No option on the command line or in #SBATCH lines: the plugstack line's default_interval= decides."""
    slurm = _fake(sacct="7|sbatch job.sh\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 1 and "not submitted with --checkpoint-interval" in r.output, r.output
    assert not slurm.ran("scancel")
    (site / "plugstack.conf").write_text("required /x/slurmckpt_spank.so default_interval=1h\n")
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 0, r.output
    assert slurm.ran("scancel")


def test_accounting_is_waited_for_briefly_and_only_for_a_running_job_without_a_run_record(site, monkeypatch):
    """slurmdbd learns of a job a few seconds after its submission: for a running job with no run record the
    submit line is asked once a second until it is there (a job that just started), at most
    ACCOUNTING_WAIT_S; then 'cannot tell yet', naming what is missing, never blaming a missing job."""
    monkeypatch.setattr(lookup, "ACCOUNTING_WAIT_S", 0.0)
    slurm = _fake(sacct=Ran(0, "")).install(monkeypatch)
    start = time.monotonic()
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert time.monotonic() - start < 2
    assert r.exit_code == 1 and "cannot tell yet" in r.output and "nothing was sent" in r.output, r.output
    assert len(slurm.ran("sacct")) == 1 and not slurm.ran("scancel")
    answers = iter(["", "7|\n", "7|sbatch job.sh\n"])              # no record, no line yet, the line
    monkeypatch.setattr(lookup, "ACCOUNTING_WAIT_S", 10.0)
    monkeypatch.setattr(lookup.time, "sleep", lambda s: None)
    slurm = _fake(sacct=lambda cmd: next(answers)).install(monkeypatch)
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 1 and "not submitted with --checkpoint-interval" in r.output, r.output
    assert len(slurm.ran("sacct")) == 3
    monkeypatch.setattr(lookup, "ACCOUNTING_WAIT_S", 0.0)      # no submit line in time: the script's #SBATCH
    slurm = _fake(scontrol=lambda cmd: SCRIPT if "batch_script" in cmd else "ClusterName = c\n").install(monkeypatch)
    assert CliRunner().invoke(cli, ["checkpoint", "7"]).exit_code == 0
    assert len(slurm.ran("sacct")) == 1 and slurm.ran("scancel")


@pytest.mark.parametrize("interval, sent", [
    ("0s", False), ("00:00", False), ("0", False), ("off", False), ("OFF", False), ("0m", False),
    ("0:00:00", False), ("0h0m", False), ("0d0h0m0s", False),
    ("5x", False), ("1h30", False),                    # the shim refuses these: no job runs with them
    ("10m", True), ("30s", True), ("00:10", True), ("1", True), ("1h30m", True),
])
def test_checkpoint_signals_only_a_job_whose_interval_is_on(site, monkeypatch, interval, sent):
    """0 in every spelling the shim accepts means off: such a job does not handle the capture signal, whose
    default action would end it, so nothing is sent; any interval above 0 gets the signal."""
    slurm = _fake(sacct=f"7|sbatch --checkpoint-interval={interval} job.sh\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert bool(slurm.ran("scancel")) is sent, r.output
    assert (r.exit_code == 0) is sent
    if not sent:
        assert "nothing was sent" in r.output


def test_an_unknown_job_fails_like_squeue_fast_and_without_accounting(site, monkeypatch):
    slurm = _fake().install(monkeypatch)
    for command in (["checkpoint", "999999"], ["requeue", "999999"], ["migrate", "999999", "--to", "node2"]):
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == 1, (command, r.output)
        assert r.output.strip() == "slurmckpt: error: Invalid job id specified: 999999", r.output
    assert not slurm.ran("sacct") and not slurm.ran("scancel")


def test_a_job_that_is_not_running_is_not_signalled(site, monkeypatch):
    slurm = _fake(squeue=squeue_answer(squeue_line(7, state="PENDING"))).install(monkeypatch)
    r = CliRunner().invoke(cli, ["requeue", "7"])
    assert r.exit_code == 1 and "job 7 is PENDING" in r.output
    assert not slurm.ran("scancel")


def test_requeue_sends_the_capture_then_requeue_signal_and_parsable_prints_the_id(site, monkeypatch):
    from slurmckpt.task.schedule import REQUEUE_SIGNAL
    slurm = _fake(sacct="7|sbatch --checkpoint-interval=10m job.sh\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["requeue", "--parsable", "--noheader", "7"])
    assert r.exit_code == 0 and r.output == "7\n", r.output
    assert slurm.ran("scancel") == [["scancel", "--batch", f"--signal={int(REQUEUE_SIGNAL)}", "7"]]
    r = CliRunner().invoke(cli, ["checkpoint", "--requeue", "--json", "7"])
    assert json.loads(r.output) == {"job_id": 7, "job": "7", "action": "checkpoint+requeue",
                                    "detail": "capture requested, then requeue"}


def test_values_the_shim_refuses_are_off():
    for value in ("1h 30m", "5x", "", None, "-1", "30s5m"):
        assert lookup.interval_on(value) is False, value


def test_a_config_with_a_bad_key_is_a_clear_error(site, monkeypatch):
    (site / "slurmckpt.yaml").write_text("keep_epoch: 3\n")
    _fake().install(monkeypatch)
    r = CliRunner().invoke(cli, ["checkpoint", "7"])
    assert r.exit_code == 1 and "unknown key 'keep_epoch'" in r.output, r.output


def test_config_lookup_order(tmp_path: Path):
    """SLURMCKPT_CONFIG, then /etc/slurmckpt, then next to the slurm.conf in use, then /etc/slurm."""
    from slurmckpt.config import config_paths
    env = {"SLURMCKPT_CONFIG": "/x/mine.yaml", "SLURM_CONF": "/srv/slurm/etc/slurm.conf"}
    assert [str(p) for p in config_paths(env)] == ["/x/mine.yaml", "/etc/slurmckpt/slurmckpt.yaml",
                                                   "/srv/slurm/etc/slurmckpt.yaml", "/etc/slurm/slurmckpt.yaml"]
    assert [str(p) for p in config_paths({})] == ["/etc/slurmckpt/slurmckpt.yaml", "/etc/slurm/slurmckpt.yaml"]
    (tmp_path / "slurmckpt.yaml").write_text("keep_epochs: 5\n")
    config = Config.load(environ={"SLURM_CONF": str(tmp_path / "slurm.conf")})
    if not Path("/etc/slurmckpt/slurmckpt.yaml").exists():
        assert config.keep_epochs == 5 and config.source == str(tmp_path / "slurmckpt.yaml")
    root = Config.load(environ={"SLURMCKPT_CONFIG": str(tmp_path / "slurmckpt.yaml")})
    assert root.source == str(tmp_path / "slurmckpt.yaml")
