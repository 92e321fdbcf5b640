"""`slurmckpt persist-final` (root, started by a rank's agent only): a final capture's staged images into the
store after the job ended (store/final_persist.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

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
    sys.exit(_persist(cluster, job, epoch, step, rank))


def _persist(cluster: str, job: int, epoch: int, step: str, rank: int) -> int:
    """The process's life: logs, out of the job's cgroups, the persist. Exit 0: in the store."""
    from slurmckpt import validate
    from slurmckpt.agent import logs as agentlog
    from slurmckpt.config import load_root_config
    from slurmckpt.node import detach
    from slurmckpt.store.final_persist import persist_handed
    from slurmckpt.store.jobstore import JobStore
    from slurmckpt.store.staging import Staging
    config = load_root_config()
    validate.label(cluster, "cluster")
    agentlog.setup(config, job, f"{validate.step(step)}-persist", validate.rank_index(rank))
    detach.leave_job_cgroups(os.getpid())        # the agent moved it already; a no-op then
    store = JobStore(Path(config.storage_root), cluster, job)
    ok = persist_handed(store, Staging(Path(config.staging_dir), config.staging_max), validate.epoch(epoch),
                        step, rank)
    return 0 if ok else 1
