"""`slurmckpt status` lists only jobs under slurmckpt with restarts and newest checkpoint, in every output format
Slurm's tools have; one job shows its epochs, failed captures and note; every subcommand has -h, and the
data commands --json, -p, -P, -n; --version."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fake_slurm import FakeSlurm, Ran, squeue_answer, squeue_line
from slurmckpt import __version__
from slurmckpt.cli import COMMANDS, cli, lookup

NOTE = "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet"


@pytest.fixture
def site(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "slurmckpt.yaml").write_text(f"summary_dir: {tmp_path}/summaries\n")
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    lookup.cluster.cache_clear()
    (tmp_path / "summaries" / "c").mkdir(parents=True)
    at = time.mktime((2026, 12, 3, 18, 20, 1, 0, 0, -1))
    (tmp_path / "summaries" / "c" / "7.json").write_text(json.dumps({
        "version": 1, "cluster": "c", "job": 7,
        "epochs": [{"epoch": 4, "committed_at": at, "trigger": "interval", "ranks": 2, "bytes": 3 << 20,
                    "nodes": ["node1", "node2"]}],
        "run": {"restart_count": 2, "started_at": at, "batch_node": "node1", "interval_s": 600},
        "failed_captures": [{"epoch": 5, "at": at, "rank": "batch.0", "node": "node1", "final": True,
                             "trigger": "sigterm", "stage": "dump", "reason": "criu: no space", "seen_by": "agent"}],
        "withdrawn": []}))
    jobs = squeue_answer(squeue_line(7, restarts=2, nodes="node[1-2]"),
                         squeue_line(8, user="ckptuser2", uid=1002, admin_comment=NOTE, restarts=1),
                         squeue_line(9, state="PENDING", nodes=""))
    FakeSlurm(squeue=jobs, scontrol="ClusterName = c\n",
              sacct=lambda cmd: Ran(0, "3|3|ckptuser1|1001|COMPLETED|debug|normal|node3|" + NOTE + "|\n"
                                    if "3" in cmd else "")).install(monkeypatch)
    return tmp_path


@pytest.mark.system
def test_status_lists_only_jobs_under_slurmckpt_with_restarts_and_newest_checkpoint(site):
    r = CliRunner().invoke(cli, ["status"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["JOBID", "USER", "STATE", "RESTARTS", "LAST_EPOCH", "COMMITTED", "SIZE", "NODELIST",
                                "NOTE"]
    assert lines[1].split()[:8] == ["7", "ckptuser1", "RUNNING", "2", "4", "2026-12-03T18:20:01", "3.0", "MiB"]
    assert lines[2].split()[:4] == ["8", "ckptuser2", "RUNNING", "1"] and NOTE in lines[2]
    assert len(lines) == 3                                     # job 9: no summary, no note: not listed
    assert len(CliRunner().invoke(cli, ["status", "--all", "-n"]).output.splitlines()) == 3


@pytest.mark.system
def test_status_formats(site):
    r = CliRunner().invoke(cli, ["status", "-p"])
    assert r.output.splitlines()[0] == "JOBID|USER|STATE|RESTARTS|LAST_EPOCH|COMMITTED|SIZE|NODELIST|NOTE|"
    assert r.output.splitlines()[1] == "7|ckptuser1|RUNNING|2|4|2026-12-03T18:20:01|3.0 MiB|node[1-2]||"
    r = CliRunner().invoke(cli, ["status", "-P", "-n"])
    assert r.output.splitlines()[0] == "7|ckptuser1|RUNNING|2|4|2026-12-03T18:20:01|3.0 MiB|node[1-2]|"
    doc = json.loads(CliRunner().invoke(cli, ["status", "--json"]).output)
    assert [d["job_id"] for d in doc] == [7, 8] and doc[0]["summary"]["epochs"][0]["bytes"] == 3 << 20
    assert doc[0]["restarts"] == 2 and doc[1]["note"] == NOTE
    assert CliRunner().invoke(cli, ["status", "--json", "-p"]).exit_code == 2


@pytest.mark.system
def test_status_of_one_job_shows_epochs_the_failed_capture_and_the_note(site):
    r = CliRunner().invoke(cli, ["status", "7"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("JobId=7 User=ckptuser1 State=RUNNING Restarts=2 Partition=debug QOS=normal "
                               "NodeList=node[1-2]\n")
    assert "newest checkpoint: epoch 4 (interval)" in r.output
    assert "\n    4 2026-12-03T18:20:01 interval     2 3.0 MiB node1,node2\n" in r.output
    assert ("last failed capture: the final capture at epoch 5 failed on rank batch.0: criu: no space (node node1, "
            "stage dump, 2026-12-03T18:20:01)") in r.output
    r = CliRunner().invoke(cli, ["status", "8"])
    assert f"AdminComment: {NOTE}" in r.output and "no checkpoint summary visible" in r.output


def test_a_job_slurmctld_forgot_comes_from_accounting_and_an_unknown_one_fails_like_scontrol(site):
    r = CliRunner().invoke(cli, ["status", "3"])
    assert r.exit_code == 0 and "JobId=3 User=ckptuser1 State=COMPLETED" in r.output and NOTE in r.output
    r = CliRunner().invoke(cli, ["status", "4"])
    assert r.exit_code == 1 and r.output == "slurmckpt: error: Invalid job id specified: 4\n"


def _commands(group: click.Group, prefix: tuple = ()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command.hidden:
            continue
        yield prefix + (name,), command
        if isinstance(command, click.Group):
            yield from _commands(command, prefix + (name,))


def test_every_subcommand_has_short_and_long_help_and_data_commands_have_the_output_options():
    names = [path for path, _ in _commands(cli)]
    assert {("status",), ("checkpoint",), ("requeue",), ("migrate",), ("list",), ("inspect",), ("doctor",),
            ("policy",), ("policy", "show"), ("policy", "check")} <= set(names)
    for path, command in _commands(cli):
        for flag in ("-h", "--help"):
            r = CliRunner().invoke(cli, [*path, flag])
            assert r.exit_code == 0 and r.output.startswith("Usage: "), (path, flag, r.output)
        if isinstance(command, click.Group):
            continue                # a group lists its commands
        opts = {o for p in command.params for o in p.opts}
        assert {"--json", "-p", "--parsable", "-P", "--parsable2", "-n", "--noheader"} <= opts, path
    assert set(cli.list_commands(click.Context(cli))) == {*COMMANDS, "agent"}     # and the hidden agent


def test_version():
    for flag in ("--version", "-V"):
        r = CliRunner().invoke(cli, [flag])
        assert r.exit_code == 0 and r.output == f"slurmckpt {__version__}\n"
