"""`slurmckpt env` (slurm/run_env.py): a restored process reads this run's Slurm variables from its wrapper, the
nearest ancestor that slurmstepd started with the agent's fd variable, never from its own environment."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmckpt.node import procfs
from slurmckpt.cli import cli
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.run_env import current_run

OLD = {"SLURM_JOB_ID": "7", "SLURM_JOB_SLUID": "s0000000000001", "SLURM_RESTART_COUNT": "1", "HOME": "/h"}
NEW = {"SLURM_JOB_ID": "7", "SLURM_JOB_SLUID": "s0000000000002", "SLURM_RESTART_COUNT": "2",
       "SLURMD_NODENAME": "node2", "SLURMCKPT_AGENT_FD": "5", "PATH": "/bin"}


def _proc(root: Path, pid: int, ppid: int, env: dict[str, str]) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """slurmstepd 10 -> wrapper 20 (this run) -> restored init 30 -> bash 40 -> program 50 (the old run's)."""
    root = tmp_path / "proc"
    _proc(root, 10, 1, {"PATH": "/usr/sbin"})
    _proc(root, 20, 10, NEW)
    _proc(root, 30, 20, {"PATH": "/bin"})
    _proc(root, 40, 30, OLD)
    _proc(root, 50, 40, OLD)
    (root / "self").symlink_to("50")
    return root


def test_a_restored_process_gets_the_wrappers_variables_of_this_run(tree: Path) -> None:
    with procfs.rooted(tree):
        assert current_run() == {"SLURMD_NODENAME": "node2", "SLURM_JOB_ID": "7",
                                 "SLURM_JOB_SLUID": "s0000000000002", "SLURM_RESTART_COUNT": "2"}


def test_a_wrapper_of_another_job_or_none_at_all_is_an_error(tree: Path) -> None:
    """An ancestor with the mark but another job's id (a job started from inside a job) is not this task's
    wrapper; a process with no wrapper above it gets an error, never its own environment back."""
    (tree / "20" / "environ").write_bytes(b"SLURM_JOB_ID=8\0SLURMCKPT_AGENT_FD=5\0")
    with procfs.rooted(tree), pytest.raises(SlurmckptError, match="no slurmckpt wrapper"):
        current_run()


def test_the_command_prints_values_by_name_lines_or_json(tree: Path) -> None:
    with procfs.rooted(tree):
        run = CliRunner().invoke(cli, ["env", "SLURM_JOB_SLUID", "SLURM_RESTART_COUNT"])
        assert (run.exit_code, run.output) == (0, "s0000000000002\n2\n")
        run = CliRunner().invoke(cli, ["env"])
        assert "SLURM_JOB_SLUID=s0000000000002\n" in run.output and "PATH" not in run.output
        run = CliRunner().invoke(cli, ["env", "SLURM_NOPE"])
        assert run.exit_code == 1 and "SLURM_NOPE" in run.output
        run = CliRunner().invoke(cli, ["env", "--json", "SLURMD_NODENAME", "SLURM_NOPE"])
        assert json.loads(run.output) == {"SLURMD_NODENAME": "node2", "SLURM_NOPE": None}
        run = CliRunner().invoke(cli, ["env", "-P", "SLURM_RESTART_COUNT"])
        assert run.output == "NAME|VALUE\nSLURM_RESTART_COUNT|2\n"


def test_the_command_outside_a_checkpointed_task_is_one_error_line(tree: Path) -> None:
    (tree / "20" / "environ").write_bytes(b"SLURM_JOB_ID=7\0")
    with procfs.rooted(tree):
        run = CliRunner().invoke(cli, ["env"])
    assert run.exit_code == 1 and "no slurmckpt wrapper among this process's ancestors" in run.output
