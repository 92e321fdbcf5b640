"""`slurmckpt gc` (root): free what the image store no longer needs (docs/storage.md, "Garbage collection");
`slurmckpt job-end` (root, started by the SPANK plugin's job epilog only): a finished job's images go at its end
(job_end.py)."""
from __future__ import annotations

import os
from pathlib import Path

import click

from slurmckpt.cli.images import store_root
from slurmckpt.cli.lookup import config
from slurmckpt.cli.output import CliError, Column, Format, emit, output_options, say
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.jobrecord import MAX_ID

COLUMNS = [Column("action", "ACTION"), Column("gib", "GIB", right=True), Column("path", "PATH"),
           Column("kind", "KIND"), Column("why", "WHY")]


@click.command()
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@output_options
def gc(dry_run: bool, fmt: Format) -> None:
    """(root) Free what the image store no longer needs: every image of a job Slurm says will not run
    again (completed, cancelled, failed, timed out; never a pending or requeued one; `keep_finished: true`
    keeps them), uncommitted epochs whose coordinator can no longer commit them, this node's staging
    areas whose agent is gone, this node's empty task cgroups of finished jobs, and this node's TCP holds
    (packet filter rules) of jobs that are finished or unknown to Slurm. Each job is asked about alone. The
    job epilog removes a finished job's images and its TCP holds at its end; this is the safety net, run
    hourly on every node by the package's timer or cron entry (docs/storage.md)."""
    from slurmckpt.node import packet_filter
    from slurmckpt.rank import leftovers
    from slurmckpt.store import reclaim
    from slurmckpt.slurm.control import CliSlurm
    from slurmckpt.store.staging import Staging
    from slurmckpt.store.jobstore import list_jobs
    if os.geteuid() != 0:
        raise CliError("gc runs as root (the image store is root's)")
    cfg = config()
    root = store_root(cfg)
    slurm = CliSlurm()
    try:
        cluster = slurm.cluster_name() or "cluster"
    except SlurmError as e:
        raise CliError(f"cannot learn the cluster's name from Slurm ({e}); nothing was removed") from e
    cgroup_jobs = leftovers.task_cgroup_jobs(cfg.freezer_root)
    filters = packet_filter.installed()
    held = leftovers.tcp_hold_jobs(filters)
    jobs = sorted({job for c, job in list_jobs(root) if c == cluster} | set(cgroup_jobs) | held)
    try:
        states = slurm.job_states(jobs) if jobs else {}
    except SlurmError as e:
        # Accounting alone cannot say that a job is over: the last record of a requeued job says PREEMPTED
        # or REQUEUED until slurmdbd hears of its next run. Without slurmctld, this run removes nothing.
        raise CliError(f"slurmctld did not say which jobs it still holds ({e}); skipped: nothing was "
                       "removed") from e
    removals = reclaim.collect_all(root, cluster, states, Staging(Path(cfg.staging_dir), cfg.staging_max),
                                   cfg.keep_finished, dry_run, cfg.summary_dir)
    removals += leftovers.collect_finished_task_cgroups(cfg.freezer_root, states, dry_run)
    removals += leftovers.collect_tcp_holds(held, states, filters, dry_run)
    rows = [{**r.as_dict(), "gib": f"{r.bytes / 2**30:.2f}",
             "action": "kept" if r.kind == "kept" else ("would remove" if dry_run else "removed")}
            for r in removals]
    emit(fmt, COLUMNS, rows, [r.as_dict() for r in removals])
    freed = [r for r in removals if r.kind != "kept"]
    say(fmt, f"{len(freed)} item(s), {sum(r.bytes for r in freed) / 2**30:.2f} GiB "
             f"{'would be freed (dry run)' if dry_run else 'freed'}")


@click.command(name="job-end", hidden=True)
@click.option("--job", type=click.IntRange(1, MAX_ID), required=True)
@click.option("--uid", type=click.IntRange(0, MAX_ID), required=True)
@click.option("--node", default="", help="slurmd's name of the node whose epilog started this.")
@click.option("--nodes", default="", help="The job's node list (a Slurm hostlist), from slurmd.")
def job_end(job: int, uid: int, node: str, nodes: str) -> None:
    """(root) A job left its nodes: its images go once Slurm says it is finished (started detached by the
    SPANK plugin's job epilog only; logs to the agent log of step "end")."""
    if os.geteuid() != 0:
        raise CliError("job-end runs as root, started by the SPANK plugin's job epilog")
    from slurmckpt.agent import logs as agentlog
    from slurmckpt.config import load_root_config
    from slurmckpt.rank.leftovers import lift_tcp_holds
    from slurmckpt.store.job_end import JobEnd, end
    from slurmckpt.slurm.control import CliSlurm
    cfg = load_root_config()
    agentlog.setup(cfg, job, "end", 0)
    end(JobEnd(job, uid, node, nodes), cfg, CliSlurm(timeout_s=20), lift_tcp_holds)
