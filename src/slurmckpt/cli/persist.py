"""`slurmckpt persist-final` (root, started by a rank's agent only): a final capture's staged images into the
store after the job ended (store/final_persist.py)."""
from __future__ import annotations

import os
import sys

import click

from slurmckpt.cli.output import CliError

MAX_ID = 0xFFFFFFFD


@click.command(name="persist-final", hidden=True)
@click.option("--cluster", required=True)
@click.option("--job", type=click.IntRange(1, MAX_ID), required=True)
@click.option("--epoch", type=click.IntRange(1), required=True)
@click.option("--step", required=True)
@click.option("--rank", type=click.IntRange(0), required=True)
def persist_final(cluster: str, job: int, epoch: int, step: str, rank: int) -> None:
    """(root) Persist one rank's final capture and commit its epoch once complete (started by its agent)."""
    if os.geteuid() != 0:
        raise CliError("persist-final runs as root, started by a rank's agent")
    from slurmckpt.store.final_persist import main
    sys.exit(main(cluster, job, epoch, step, rank))
