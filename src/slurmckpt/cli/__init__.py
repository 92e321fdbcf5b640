"""`slurmckpt` command line: a thin layer over the modules, the catch-all error boundary for users.

Every subcommand takes -h/--help; those that print data take --json, -p/--parsable, -P/--parsable2 and
-n/--noheader (cli/output.py). Subcommands live in one module per concern and are listed in COMMANDS.
"""
from __future__ import annotations

import os
import sys

import click

from slurmckpt import __version__
from slurmckpt.cli.doctor import doctor
from slurmckpt.cli.images import inspect, list_cmd
from slurmckpt.cli.jobs import checkpoint, migrate, requeue
from slurmckpt.cli.output import CliError
from slurmckpt.cli.policy import policy
from slurmckpt.cli.status import status
from slurmckpt.errors import SlurmckptError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="slurmckpt", message="%(prog)s %(version)s")
def cli() -> None:
    """Transparent checkpoint/restore for Slurm jobs: status and control of checkpointed jobs, the image
    store, the site policy, and a node check. See slurmckpt(1) and slurmckpt.yaml(5)."""


@cli.command(hidden=True)
@click.option("--fd", type=int, required=True)
@click.option("--job", type=int, required=True)
@click.option("--step", required=True)
@click.option("--rank", type=int, required=True)
@click.option("--uid", type=int, required=True)
@click.option("--gid", type=int, required=True)
@click.option("--restart-count", type=int, default=0)
@click.option("--init", default=None)
@click.option("--interval", type=int, default=None)
@click.option("--interval-from", type=click.Choice(["option", "default"]), default="option")
@click.option("--log-fd", type=int, default=None)
def agent(**args) -> None:
    """Per-task privileged agent (started by the SPANK plugin only)."""
    if os.geteuid() != 0:
        raise CliError("the agent runs as root, started by slurmstepd")
    from slurmckpt.agent_start import ShimArgs, run_agent
    run_agent(ShimArgs(**args))


# Each command module adds its command here (the image store's garbage collection goes in as `gc`).
COMMANDS = (status, checkpoint, requeue, migrate, list_cmd, inspect, policy, doctor)
for command in COMMANDS:
    cli.add_command(command)


def main() -> None:
    try:
        cli(prog_name="slurmckpt", standalone_mode=True)
    except SlurmckptError as e:
        click.echo(f"slurmckpt: error: {e}", err=True)
        sys.exit(1)
