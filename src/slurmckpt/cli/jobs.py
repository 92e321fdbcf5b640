"""`slurmckpt checkpoint | requeue | migrate JOB`: ask a running job's batch wrapper for a capture through Slurm
(`scancel --batch --signal`, so Slurm authorises it: the job's owner or an admin), then, for migrate, point
the requeued job at its new node (docs/operations.md, "Command line")."""
from __future__ import annotations

import time
from typing import Callable

import click

from slurmckpt.cli.lookup import JOB, config, job_summary, label, queued, require_owner, runs_under_slurmckpt
from slurmckpt.cli.output import CliError, Column, Format, emit, output_options, say
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.slurm.jobrecord import expand_hostlist
from slurmckpt.slurm.jobref import JobRef
from slurmckpt.slurm.queue import QueuedJob
from slurmckpt.task.schedule import CHECKPOINT_SIGNAL, REQUEUE_SIGNAL

BAD_NODE_STATES = ("DOWN", "DRAIN", "FAIL", "FUTURE", "NOT_RESPONDING", "POWER", "REBOOT", "MAINT")
RESULT = [Column("job", "JOBID"), Column("action", "ACTION"), Column("detail", "DETAIL")]


def _signal_capture(ref: JobRef, requeue: bool, force: bool, fmt: Format) -> QueuedJob:
    job = queued(ref)
    require_owner(job, "sent")
    if job.state != "RUNNING":
        raise CliError(f"job {label(job)} is {job.state}: only a running job can be captured; nothing was sent")
    if not force:
        on, how = runs_under_slurmckpt(job, config())
        if on is None:
            raise CliError(f"cannot tell yet whether job {label(job)} runs under slurmckpt ({how}); the capture "
                           "signal would end a job that does not: nothing was sent (try again in a few seconds, "
                           "or --force)")
        if not on:
            raise CliError(f"job {label(job)} does not run under slurmckpt ({how}): the capture signal would end "
                           "it; nothing was sent (--force sends it anyway)")
    try:
        CliSlurm(timeout_s=30).signal_batch(job.job_id, int(REQUEUE_SIGNAL if requeue else CHECKPOINT_SIGNAL))
    except SlurmError as e:
        raise CliError(f"scancel refused: {e}") from e
    return job


def _report(fmt: Format, job: QueuedJob, action: str, detail: str) -> None:
    if fmt.kind in ("parsable", "parsable2") and not fmt.header:
        click.echo(job.job_id)              # like sbatch --parsable: the id alone
        return
    emit(fmt, RESULT, [{"job": job.job_id, "action": action, "detail": detail}],
         {"job_id": job.job_id, "job": job.spec, "action": action, "detail": detail})


@click.command()
@click.argument("job", type=JOB)
@click.option("--requeue", is_flag=True, help="Capture, then requeue the job (same as `slurmckpt requeue`).")
@click.option("--force", is_flag=True, help="Signal even if the job does not look checkpointable.")
@output_options
def checkpoint(job: JobRef, requeue: bool, force: bool, fmt: Format) -> None:
    """Capture JOB (N, or N_M for an array task) now; it keeps running unless --requeue."""
    found = _signal_capture(job, requeue, force, fmt)
    _report(fmt, found, "checkpoint+requeue" if requeue else "checkpoint",
            "capture requested" + (", then requeue" if requeue else ""))


@click.command()
@click.argument("job", type=JOB)
@click.option("--force", is_flag=True, help="Signal even if the job does not look checkpointable.")
@output_options
def requeue(job: JobRef, force: bool, fmt: Format) -> None:
    """Capture JOB, then requeue it: it resumes from this capture when Slurm starts it again."""
    found = _signal_capture(job, True, force, fmt)
    _report(fmt, found, "requeue", "capture requested, then requeue")


def _wait(job: QueuedJob, done: Callable[[QueuedJob], bool], what: str, timeout_s: float) -> QueuedJob:
    ref = JobRef(job.job_id)
    deadline = time.monotonic() + timeout_s
    while True:
        now = queued(ref)
        if done(now):
            return now
        if now.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            raise CliError(f"job {job.spec} ended ({now.state}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise CliError(f"job {job.spec}: no {what} within {timeout_s:.0f}s (state {now.state})")
        time.sleep(0.3)


def _check_target(job: QueuedJob, target: str) -> list[str]:
    slurm = CliSlurm(timeout_s=10)
    nodes = expand_hostlist(target)
    if not nodes:
        raise CliError(f"--to {target!r}: no node named")
    for node in nodes:
        try:
            info = slurm.node_state(node)
        except SlurmError as e:
            raise CliError(f"--to {node}: Slurm knows no such node ({e})") from e
        state = info.get("State", "")
        if any(bad in state for bad in BAD_NODE_STATES):
            raise CliError(f"--to {node}: the node is {state}; nothing was sent")
        if job.partition and job.partition not in info.get("Partitions", "").split(","):
            raise CliError(f"--to {node}: not in the job's partition {job.partition}; nothing was sent")
    if set(nodes) == set(expand_hostlist(job.nodes)):
        raise CliError(f"job {job.spec} already runs on {job.nodes}; nothing was sent")
    return nodes


@click.command()
@click.argument("job", type=JOB)
@click.option("--to", "target", required=True, metavar="NODE[S]",
              help="The node (or Slurm hostlist, one node per node of the job) to run on.")
@click.option("--no-wait", is_flag=True, help="Return once the requeued job points at the new node(s).")
@click.option("--timeout", type=click.FloatRange(1, 86400), default=900.0, show_default=True,
              help="Seconds to wait for each phase (capture and requeue, then the restart).")
@output_options
def migrate(job: JobRef, target: str, no_wait: bool, timeout: float, fmt: Format) -> None:
    """Move JOB to another node: capture it, requeue it with `ReqNodeList=NODE`, and (unless --no-wait) wait
    until it runs there again, restored from the capture. The job keeps NODE as its ReqNodeList afterwards."""
    found = queued(job)
    require_owner(found, "sent")
    nodes = _check_target(found, target)
    found = _signal_capture(job, True, False, fmt)
    say(fmt, f"job {found.spec}: capture requested; waiting for Slurm to requeue it")
    # Slurm makes a requeued job eligible only after its requeue delay (cred_expire, or requeue_delay= of
    # SchedulerParameters since 25.11): the node list is set while it is pending. With requeue_delay=0, or a
    # job submitted with --requeue=expedite, it may start again first (a higher restart count): Slurm then
    # refuses the update.
    _wait(found, lambda j: j.state == "PENDING" or (j.state == "RUNNING" and j.restarts > found.restarts),
          "the capture and requeue", timeout)
    try:
        CliSlurm(timeout_s=30).update_job(found.job_id, ReqNodeList=",".join(nodes))
    except SlurmError as e:
        raise CliError(f"the job was requeued but Slurm refused ReqNodeList={','.join(nodes)}: {e}; it "
                       "restarts wherever Slurm puts it (a requeue delay of 0, SchedulerParameters=requeue_delay=0 "
                       "or --requeue=expedite, can start it before its node list is set)") from e
    detail = f"requeued with ReqNodeList={','.join(nodes)}"
    if not no_wait:
        say(fmt, f"job {found.spec}: {detail}; waiting for it to run there")
        running = _wait(found, lambda j: j.state == "RUNNING", "the restart on the new node", timeout)
        detail = f"running on {running.nodes} (restart {running.restarts})"
        restored = _restored_epoch(running)
        if restored:
            detail += f", {restored}"
    _report(fmt, found, "migrate", detail)


def _restored_epoch(job: QueuedJob, wait_s: float = 60.0) -> str | None:
    """What the restarted batch step did, from its run record (if the caller may read the summary)."""
    cfg = config()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        info = job_summary(cfg, job.job_id)
        if info is None:            # not readable here (another user's job, no shared summary_dir)
            return None
        run = info.get("run") or {}
        if run.get("restart_count") == job.restarts and run.get("restored_epoch") is not None:
            return f"restored from checkpoint epoch {run['restored_epoch']}"
        if run.get("restart_count") == job.restarts and run.get("fresh_start"):
            return f"started from the beginning: {run['fresh_start']}"
        time.sleep(0.5)
    return None
