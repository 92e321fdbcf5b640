"""io_uring blocked in every tree (docs/gpu.md, "io_uring"): the job's opt-out read on the user side, the site's
key and the job's wish combined by the root agent, and init's flag on the command it runs. What the filter does
is tested on the real kernel by spank/tests/init_test.sh and in a job by tests/integration/test_io_uring.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmckpt.config import Config
from slurmckpt.errors import ProtocolError
from slurmckpt.node import launch
from slurmckpt.task import defaults as task_defaults
from test_job_instance import _agent, _me


@pytest.mark.parametrize("env, wanted, complains", [
    ({}, False, False),
    ({"SLURMCKPT_IO_URING": "block"}, False, False),
    ({"SLURMCKPT_IO_URING": "allow"}, True, False),
    ({"SLURMCKPT_IO_URING": "yes"}, False, True),         # neither: blocked, and the job is told
    ({"SLURMCKPT_IO_URING": ""}, False, True)])
def test_the_job_opts_out_with_slurmckpt_io_uring_allow_and_nothing_else(env, wanted, complains) -> None:
    got, complaint = task_defaults.io_uring_wanted(env)
    assert got is wanted
    assert bool(complaint) is complains
    if complaint:
        assert "SLURMCKPT_IO_URING=" in complaint and "stays blocked" in complaint


def test_init_gets_the_flag_before_the_workloads_argv() -> None:
    creds = launch.Credentials(1001, 1001, (), ())
    plain = launch.init_command(creds, "/init", ["prog", "--block-io-uring"], "/home", "/w", 3)
    assert plain[plain.index("--") + 1:] == ["prog", "--block-io-uring"]
    assert "--block-io-uring" not in plain[:plain.index("--")]
    blocked = launch.init_command(creds, "/init", ["prog"], "/home", "/w", 3, block_io_uring=True)
    assert blocked[blocked.index("/init"):] == ["/init", "--chdir", "/home", "--workdir", "/w", "--env-fd", "3",
                                                "--block-io-uring", "--", "prog"]


@pytest.mark.parametrize("site, request_field, blocked", [
    (True, {}, True),                              # the default: blocked
    (True, {"allow_io_uring": False}, True),
    (True, {"allow_io_uring": True}, False),       # the job's opt-out
    (False, {}, False),                            # the site's
    (False, {"allow_io_uring": True}, False)])
def test_the_agent_blocks_io_uring_unless_the_site_or_the_job_said_otherwise(tmp_path: Path, monkeypatch, site,
                                                                            request_field, blocked) -> None:
    from slurmckpt.agent import tree as agent_mod
    calls: list[dict] = []
    monkeypatch.setattr(agent_mod, "spawn_tree", lambda *args, **kw: calls.append(kw) or 4242)
    monkeypatch.setattr(agent_mod, "init_home", lambda *args: "/nonexistent")
    a = _agent(tmp_path, _me())
    a.facts.config = Config(block_io_uring=site, run_dir=str(tmp_path))
    a.tree._task_credentials = lambda: None
    a.tree._place_with_slurm = lambda: None
    a.tree._context = lambda creds, pid: pid
    a.tree.runner = SimpleNamespace(root_pid=None, started=lambda ctx: None)
    request = {"argv": ["sleep"], "env": {"SLURMCKPT_IO_URING": "allow"}, "cwd": "/", **request_field}
    assert a.tree.launch(request, [0, 1, 2]) == {"pid": 4242}
    assert calls[-1]["block_io_uring"] is blocked      # the request's field decides, never its environment


def test_a_launch_whose_io_uring_field_is_no_bool_is_refused(tmp_path: Path) -> None:
    a = _agent(tmp_path, _me())
    for value in ("allow", 1, None):
        with pytest.raises(ProtocolError, match="allow_io_uring"):
            a.tree.launch({"argv": ["sleep"], "env": {}, "cwd": "/", "allow_io_uring": value}, [0, 1, 2])


def test_the_site_key_defaults_to_blocked_and_reads_as_a_bool() -> None:
    assert Config().block_io_uring is True
    assert Config.from_mapping({"block_io_uring": False}).block_io_uring is False
