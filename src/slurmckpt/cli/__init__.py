"""`slurmckpt` command line: a thin layer over the modules, the catch-all error boundary for users.

Every subcommand takes -h/--help; those that print data take --json, -p/--parsable, -P/--parsable2 and
-n/--noheader (cli/output.py). Subcommands live in one module per concern and are listed in COMMANDS.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from slurmckpt import __version__
from slurmckpt.cli.output import CliError
from slurmckpt.errors import SlurmckptError

# name -> "module:attribute"; each imported only when it runs (a fast `slurmckpt policy check` for
# cli_filter.lua, a fast `status`).
COMMANDS = {
    "status": "slurmckpt.cli.status:status",
    "checkpoint": "slurmckpt.cli.jobs:checkpoint",
    "requeue": "slurmckpt.cli.jobs:requeue",
    "migrate": "slurmckpt.cli.jobs:migrate",
    "list": "slurmckpt.cli.images:list_cmd",
    "inspect": "slurmckpt.cli.images:inspect",
    "policy": "slurmckpt.cli.policy:policy",
    "doctor": "slurmckpt.cli.doctor:doctor",
    "gc": "slurmckpt.cli.gc:gc",
    "job-end": "slurmckpt.cli.gc:job_end",
    "persist-final": "slurmckpt.cli.persist:persist_final",
    "env": "slurmckpt.cli.runenv:env",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            module, _, attr = COMMANDS[name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, name)


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@click.group(cls=LazyGroup, context_settings=CONTEXT)
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
@click.option("--interval", default=None, help="Seconds, or auto.")
@click.option("--interval-from", type=click.Choice(["option", "default"]), default="option")
@click.option("--log-fd", type=int, default=None)
def agent(**args: Any) -> None:
    """Per-task privileged agent (started by the SPANK plugin only)."""
    if os.geteuid() != 0:
        raise CliError("the agent runs as root, started by slurmstepd")
    from slurmckpt.agent.start import ShimArgs, run_agent
    run_agent(ShimArgs(**args))


def main() -> None:
    try:
        cli(prog_name="slurmckpt", standalone_mode=True)
    except SlurmckptError as e:
        click.echo(f"slurmckpt: error: {e}", err=True)
        sys.exit(1)
