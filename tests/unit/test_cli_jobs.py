"""The CLI names exactly the job the user wrote, signals only the caller's own jobs, and prints what users
wrote escaped."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import slurmckpt.cli as cli
from fake_slurm import FakeSlurm
from slurmckpt.errors import SlurmError
from slurmckpt.slurm import jobref
from slurmckpt.slurm.jobref import BadJobSpec, JobRef, parse_job_spec

SCONTROL_ARRAY = ("JobId=1240 ArrayJobId=1234 ArrayTaskId=5 JobName=a UserId=ckptuser1(1001) GroupId=x(1001)\n"
                  "JobId=1239 ArrayJobId=1234 ArrayTaskId=4 JobName=a UserId=ckptuser1(1001) GroupId=x(1001)\n")


@pytest.mark.parametrize("text,ref", [("7", JobRef(7)), ("1234", JobRef(1234)), ("1234_5", JobRef(1234, 5)),
                                      ("1234_0", JobRef(1234, 0))])
def test_job_specs_accepted(text, ref):
    assert parse_job_spec(text) == ref


@pytest.mark.parametrize("text", ["1234_5_6", "1_2_3", "12a34", " 12", "12 ", "-1", "0", "012", "1234_", "_5",
                                  "1234_05", "1e3", "0x10", "12.5", "１２", "99999999999", "1234+5", "1234_[1-3]",
                                  "", "1_000", "1234\n"])
def test_everything_else_is_refused(text):
    with pytest.raises(BadJobSpec):
        parse_job_spec(text)


def test_the_old_int_parse_named_another_job():
    assert int("1234_5") == 12345            # what click's type=int did with an array task id


def test_array_task_resolves_through_slurm_to_its_own_job_id():
    calls = []

    def run(*cmd):
        calls.append(cmd)
        return SCONTROL_ARRAY
    info = jobref.resolve(JobRef(1234, 5), run)
    assert (info.job_id, info.uid) == (1240, 1001)
    assert calls[0] == ("scontrol", "-o", "show", "job", "1234_5")


def test_plain_job_takes_the_line_of_exactly_that_id():
    out = "JobId=12345 UserId=other(1002)\nJobId=1234 UserId=ckptuser1(1001)\n"
    assert jobref.resolve(JobRef(1234), lambda *c: out).uid == 1001


def test_forgotten_job_resolves_through_accounting_and_unknown_is_an_error():
    def run(*cmd):
        if cmd[0] == "scontrol":
            raise SlurmError("Invalid job id specified")
        return "1240|1234_5|1001\n1239|1234_4|1001\n"
    assert jobref.resolve(JobRef(1234, 5), run).job_id == 1240
    with pytest.raises(SlurmError, match="no job 1234_9"):
        jobref.resolve(JobRef(1234, 9), run)


def _fake_slurm(monkeypatch, uid: int, job_id: int = 1240):
    def resolve(ref, run):
        return jobref.JobInfo(job_id, uid, ref)
    monkeypatch.setattr(jobref, "resolve", resolve)
    monkeypatch.setattr(cli, "submitted_interval", lambda job, wait_s=20.0: "10s")
    return FakeSlurm().install(monkeypatch).calls


def test_checkpoint_refuses_another_users_job_before_any_signal(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1002)
    monkeypatch.setattr(os, "getuid", lambda: 1002)
    sent = _fake_slurm(monkeypatch, uid=1001)
    r = CliRunner().invoke(cli.cli, ["checkpoint", "1234_5"])
    assert r.exit_code != 0 and "refused" in r.output and "uid 1001" in r.output
    assert not [c for c in sent if c[0] == "scancel"], "a signal was sent to another user's job"


def test_checkpoint_of_an_array_task_signals_its_own_job_id(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1001)
    monkeypatch.setattr(os, "getuid", lambda: 1001)
    sent = _fake_slurm(monkeypatch, uid=1001)
    r = CliRunner().invoke(cli.cli, ["checkpoint", "1234_5"])
    assert r.exit_code == 0, r.output
    assert [c for c in sent if c[0] == "scancel"][0][-1] == "1240"


def test_root_may_checkpoint_any_users_job(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    sent = _fake_slurm(monkeypatch, uid=1001)
    assert CliRunner().invoke(cli.cli, ["checkpoint", "1234"]).exit_code == 0
    assert any(c[0] == "scancel" for c in sent)


@pytest.mark.parametrize("command", ["checkpoint", "inspect", "status"])
@pytest.mark.parametrize("bad", ["1234_5_6", "12a34", "1234_", "-5"])
def test_commands_refuse_malformed_job_ids_with_a_clear_error(monkeypatch, command, bad):
    sent = _fake_slurm(monkeypatch, uid=os.getuid())
    r = CliRunner().invoke(cli.cli, [command, "--", bad])
    assert r.exit_code == 2 and "is not a job id" in r.output, r.output
    assert sent == []


def test_shown_escapes_control_characters_and_terminal_sequences():
    assert cli.shown("/home/u/out.txt") == "/home/u/out.txt"
    assert cli.shown("naïve ünïcode") == "naïve ünïcode"
    for hostile in ("\x1b[2J\x1b[H", "a\nb", "x\rroot# ", "\x1b]0;title\x07", "evil\u202etxt.exe", "\x9b31m"):
        out = cli.shown(hostile)
        assert out.isprintable() and "\x1b" not in out and "\u202e" not in out, out


def test_inspect_prints_user_strings_escaped(monkeypatch, tmp_path: Path):
    from slurmckpt.storage import JobStore
    root = tmp_path / "images"
    store = JobStore(root, "c", 77)
    store.ensure()
    rdir = store.rank_dir(1, "batch", 0)
    rdir.mkdir(parents=True)
    store.write_rank_manifest(1, "batch", 0, {
        "kind": "image", "node": "n1", "processes": 1, "uid": 1001, "argv": ["python", "\x1b[2Jx.py"],
        "outputs": [{"fd": 1, "link": "/home/u/\x1b]0;pwned\x07out", "size": 3}],
        "truncate": [{"path": "/tmp/a\nfake line", "size": 1}]})
    store.commit(1, {"batch.0": {"kind": "image", "node": "n1"}}, "interval", 2)
    monkeypatch.setattr(cli.Config, "load", classmethod(lambda c: cli.Config.from_mapping(
        {"storage_root": str(root)})))
    r = CliRunner().invoke(cli.cli, ["inspect", "77"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output and "fake line\n" not in r.output
    assert "\\x1b[2Jx.py" in r.output and "\\x1b]0;pwned\\x07out" in r.output
    json.dumps(r.output)
