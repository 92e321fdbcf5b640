"""etc/cli_filter.lua, run by Lua 5.1 (the Lua Slurm's cli_filter/lua links on Debian) with the `slurm` table
cli_filter gives it: a job with --checkpoint-interval is checked by the real `slurmckpt policy check` against
the config's policy, a refusal fails the submission with the CLI's message, everything else passes, and the
job's option values reach the command as they are (quoted: no shell reads them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
LUA = "lua5.1"
pytestmark = pytest.mark.system      # Lua 5.1 comes with the node's set-up (scripts/setup.sh packages)

HARNESS = r"""
slurm = { SUCCESS = 0, ERROR = -1 }
errors = {}
function slurm.log_error(fmt, ...) table.insert(errors, string.format(fmt, ...)) end
dofile(arg[1])
slurmckpt_commands = { "/nonexistent/slurmckpt", arg[2] }
local options = { type = arg[3], spank = { slurmckpt = {} } }
if arg[4] ~= "" then options.spank.slurmckpt["checkpoint-interval"] = arg[4] end
if arg[5] ~= "" then options.partition = arg[5] end
if arg[6] ~= "" then options.qos = arg[6] end
print("rc=" .. slurm_cli_pre_submit(options, 0))
for _, e in ipairs(errors) do print("error=" .. e) end
"""


@pytest.fixture
def site(tmp_path: Path) -> dict:
    (tmp_path / "h.lua").write_text(HARNESS)
    (tmp_path / "slurmckpt.yaml").write_text(yaml.safe_dump({"policy": {
        "partitions": {"high": {"allowed": False}, "low": {"min_interval": "10m"}}}}))
    cli = tmp_path / "slurmckpt"
    cli.write_text(f"#!/bin/sh\nexec {sys.executable} -m slurmckpt \"$@\"\n")
    cli.chmod(0o755)
    spy = tmp_path / "spy"
    spy.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {tmp_path}/argv\necho ok\n")
    spy.chmod(0o755)
    env = {**os.environ, "SLURMCKPT_CONFIG": str(tmp_path / "slurmckpt.yaml"),
           "PYTHONPATH": str(REPO / "src"), "SLURM_JOB_ID": ""}
    env.pop("SLURM_JOB_ID")
    return {"dir": tmp_path, "cli": str(cli), "spy": str(spy), "env": env}


def run(site: dict, interval: str, partition: str = "", qos: str = "", kind: str = "sbatch",
        command: str | None = None, env: dict | None = None) -> list[str]:
    p = subprocess.run([LUA, str(site["dir"] / "h.lua"), str(REPO / "etc" / "cli_filter.lua"),
                        command or site["cli"], kind, interval, partition, qos],
                       capture_output=True, text=True, env=env or site["env"], timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_a_value_the_policy_refuses_fails_the_submission_with_the_clis_message(site):
    assert run(site, "5m", "low") == ["rc=-1", "error=slurmckpt: --checkpoint-interval=5m: below the minimum 10m "
                                               "of partition low (site policy); see `slurmckpt policy show`"]
    assert run(site, "1h", "high")[1].startswith("error=slurmckpt: --checkpoint-interval=1h: checkpoints are not "
                                                 "allowed in partition high")
    assert run(site, "1h", "low,high")[0] == "rc=-1"
    assert run(site, "30m", "low") == ["rc=0"]
    assert run(site, "off", "high") == ["rc=0"]
    assert run(site, "auto", "low") == ["rc=0"]                     # auto never chooses below the minimum
    assert run(site, "auto", "high")[1].startswith("error=slurmckpt: --checkpoint-interval=auto: checkpoints are "
                                                   "not allowed in partition high")


def test_jobs_without_the_option_and_steps_inside_a_job_are_not_looked_at(site):
    assert run(site, "", "high", command=site["spy"]) == ["rc=0"]
    assert not (site["dir"] / "argv").exists()
    inside = {**site["env"], "SLURM_JOB_ID": "12"}
    assert run(site, "5m", "low", kind="srun", command=site["spy"], env=inside) == ["rc=0"]
    assert not (site["dir"] / "argv").exists()
    assert run(site, "5m", "low", kind="srun")[0] == "rc=-1"          # srun that makes its own allocation


def test_option_values_reach_the_command_verbatim(site):
    evil = "lo'w; touch pwned $(id) `id`"
    assert run(site, "5m", evil, "q'os", command=site["spy"]) == ["rc=0"]
    assert (site["dir"] / "argv").read_text().splitlines() == ["policy", "check", "--interval", "5m", "--partition",
                                                               evil, "--qos", "q'os"]
    assert not (site["dir"] / "pwned").exists()


def test_no_command_or_a_broken_one_lets_the_job_through_and_says_so(site):
    out = run(site, "5m", "low", command="/nonexistent/too")
    assert out[0] == "rc=0" and "no slurmckpt command found" in out[1]
    broken = site["dir"] / "broken"
    broken.write_text("#!/bin/sh\necho Traceback boom\nexit 1\n")
    broken.chmod(0o755)
    out = run(site, "5m", "low", command=str(broken))
    assert out == ["rc=0", "error=slurmckpt: the site policy could not be checked (Traceback boom); the job's agents "
                           "will apply it"]
