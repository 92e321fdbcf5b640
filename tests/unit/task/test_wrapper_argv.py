"""The task's command as the wrapper rebuilds it, for each launch form of the shim (docs/contracts.md, "SPANK
shim behaviour"): Slurm >= 23.02.5 prepends the wrapper (SLURMCKPT_TASK_ARGV=prepended), older Slurm replaces
argv[0] (SLURMCKPT_TASK_ARGV0), by hand `slurmckpt-wrap [--] CMD`. The C side of the same contract:
spank/tests/task_wrap_test.c."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import slurmckpt
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.env import PRIVATE, TaskEnv
from slurmckpt.task.wrapper import task_argv

BASE = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}


def env(**extra: str) -> TaskEnv:
    return TaskEnv.from_environ({**BASE, **extra})


@pytest.mark.parametrize("args, want", [
    (["hostname", "-s"], ["hostname", "-s"]),
    (["/var/spool/slurmd/job7/slurm_script"], ["/var/spool/slurmd/job7/slurm_script"]),
    (["--", "x"], ["--", "x"]),                    # the task's own argv[0] may be "--": nothing is stripped
])
def test_prepended_form_keeps_the_task_argv_as_it_was(args: list[str], want: list[str]) -> None:
    assert task_argv(env(SLURMCKPT_TASK_ARGV="prepended"), args) == want


@pytest.mark.parametrize("args, want", [
    (["-s"], ["hostname", "-s"]),
    ([], ["hostname"]),
    (["--", "x"], ["hostname", "--", "x"]),        # a "--" after argv[0] is the task's argument
])
def test_argv0_form_puts_the_original_argv0_back(args: list[str], want: list[str]) -> None:
    assert task_argv(env(SLURMCKPT_TASK_ARGV0="hostname"), args) == want


@pytest.mark.parametrize("args, want", [(["--", "sleep", "1"], ["sleep", "1"]), (["sleep", "1"], ["sleep", "1"])])
def test_by_hand(args: list[str], want: list[str]) -> None:
    assert task_argv(env(), args) == want


@pytest.mark.parametrize("extra, args, why", [
    ({"SLURMCKPT_TASK_ARGV": "appended"}, ["x"], "unknown launch form"),
    ({"SLURMCKPT_TASK_ARGV": "prepended", "SLURMCKPT_TASK_ARGV0": "x"}, ["y"], "with SLURMCKPT_TASK_ARGV0 set"),
    ({"SLURMCKPT_TASK_ARGV": "prepended"}, [], "no command"),
    ({}, ["--"], "no command"),
])
def test_refused(extra: dict[str, str], args: list[str], why: str) -> None:
    with pytest.raises(SlurmckptError, match=why):
        task_argv(env(**extra), args)


def test_launch_form_variables_are_private() -> None:
    assert {"SLURMCKPT_TASK_ARGV", "SLURMCKPT_TASK_ARGV0"} <= set(PRIVATE)


@pytest.mark.parametrize("form, args", [
    ({"SLURMCKPT_TASK_ARGV": "prepended"}, ["sh", "-c", 'echo "$0|$1"', "zero", "a b"]),
    ({"SLURMCKPT_TASK_ARGV0": "sh"}, ["-c", 'echo "$0|$1"', "zero", "a b"]),
])
def test_main_execs_the_task_in_either_form(form: dict[str, str], args: list[str]) -> None:
    """Without an agent the wrapper execs the command itself (PATH lookup of the bare `sh` included)."""
    child_env = {**os.environ, **BASE, **form, "PYTHONPATH": str(Path(slurmckpt.__file__).parents[1])}
    child_env.pop("SLURMCKPT_AGENT_FD", None)
    for other in {"SLURMCKPT_TASK_ARGV", "SLURMCKPT_TASK_ARGV0"} - set(form):
        child_env.pop(other, None)
    out = subprocess.run([sys.executable, "-c", "import sys; from slurmckpt.task.wrapper import main; "
                          "sys.argv[0] = 'slurmckpt-wrap'; main()", *args],
                         env=child_env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "zero|a b\n"


@pytest.mark.parametrize("value", ["-5", "4294967291", ""])
def test_the_batch_step_id_of_every_release_is_the_batch_step(value: str) -> None:
    """26.05 sets SLURM_STEP_ID in the batch step too, SLURM_BATCH_SCRIPT printed signed ("-5"); older releases
    leave it unset."""
    assert env(SLURM_STEP_ID=value).step == "batch"
    assert TaskEnv.from_environ({"SLURM_JOB_ID": "7"}).step == "batch"
    assert env(SLURM_STEP_ID="0").step == "0"
