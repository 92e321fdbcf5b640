"""`slurmckpt status [JOB]`: jobs under slurmckpt with their restarts and newest checkpoint, from slurmctld
(one squeue call) and the job summaries their users may read (summary.py); for one job also its epochs,
failed captures and slurmckpt's note in the job's comment field. Accounting is asked only for one job
slurmctld no longer knows."""
from __future__ import annotations

import os
import pwd
from typing import Any

import click

from slurmckpt.cli.lookup import JOB, SACCT_TIMEOUT_S, SQUEUE_TIMEOUT_S, config, job_summary, queued
from slurmckpt.cli.output import (CliError, Column, Format, JobNotFoundError, emit, output_options, say,
                                  shown, when)
from slurmckpt.duration import format_duration, format_interval
from slurmckpt.errors import SlurmError
from slurmckpt.config import Config
from slurmckpt.store.fresh_start import CaptureFailure
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.slurm.jobref import JobRef
from slurmckpt.slurm.queue import QueuedJob, note_in
from slurmckpt.sizes import size_text

COLUMNS = [Column("job", "JOBID", right=True), Column("user", "USER"), Column("state", "STATE"),
           Column("restarts", "RESTARTS", right=True), Column("epoch", "LAST_EPOCH", right=True),
           Column("committed", "COMMITTED"), Column("size", "SIZE", right=True), Column("nodes", "NODELIST"),
           Column("note", "NOTE")]
EPOCH_COLUMNS = [Column("epoch", "EPOCH", right=True), Column("committed", "COMMITTED"),
                 Column("trigger", "TRIGGER"), Column("ranks", "RANKS", right=True),
                 Column("size", "SIZE", right=True), Column("nodes", "NODES")]


def row(job: dict[str, Any], info: dict[str, Any] | None) -> dict[str, Any]:
    """One job's line: what slurmctld (or accounting) says, and its newest checkpoint."""
    newest = ((info or {}).get("epochs") or [None])[0]
    return {**job, "epoch": newest["epoch"] if newest else None,
            "committed": when(newest["committed_at"]) if newest else None,
            "size": size_text(newest["bytes"]) if newest else None,
            "bytes": newest["bytes"] if newest else None}


def _queued_row(j: QueuedJob) -> dict[str, Any]:
    field, note = j.slurmckpt_note()
    return {"job": j.spec, "job_id": j.job_id, "user": j.user, "state": j.state, "restarts": j.restarts,
            "partition": j.partition, "qos": j.qos, "nodes": j.nodes or j.reason, "note": note, "note_field": field}


def _queued_rows(user: str | None) -> list[dict[str, Any]]:
    try:
        return [_queued_row(j) for j in CliSlurm(timeout_s=SQUEUE_TIMEOUT_S).queued(user=user)]
    except SlurmError as e:
        raise CliError(str(e)) from e


def _one(ref: JobRef) -> dict[str, Any]:
    try:
        return _queued_row(queued(ref))
    except JobNotFoundError:
        pass
    try:    # ended longer ago than slurmctld's MinJobAge: accounting, once, briefly
        a = CliSlurm(timeout_s=SACCT_TIMEOUT_S).accounted(str(ref))
    except SlurmError:
        a = None
    if a is None or not a.get("JobIDRaw", "").isdigit():
        raise JobNotFoundError(str(ref))
    field, note = note_in({"AdminComment": a.get("AdminComment", ""), "Comment": a.get("Comment", "")})
    return {"job": a.get("JobID"), "job_id": int(a["JobIDRaw"]), "user": a.get("User"), "state": a.get("State"),
            "restarts": None, "partition": a.get("Partition"), "qos": a.get("QOS"), "nodes": a.get("NodeList"),
            "note": note, "note_field": field}


@click.command()
@click.argument("jobs", type=JOB, nargs=-1)
@click.option("-u", "--user", help="Only this user's jobs (default: yours; root: everyone's).")
@click.option("-a", "--all", "show_all", is_flag=True, help="Every job, also those not under slurmckpt.")
@output_options
def status(jobs: tuple[JobRef, ...], user: str | None, show_all: bool, fmt: Format) -> None:
    """Jobs under slurmckpt: state, restart count, newest checkpoint (epoch, time, size) and slurmckpt's
    note. With JOB: that job's epochs, failed captures and note as well (its user and root see them)."""
    cfg = config()
    if jobs:
        rows = [row(j, job_summary(cfg, j["job_id"])) for j in (_one(ref) for ref in jobs)]
    else:
        if user is None and os.geteuid() != 0:
            user = pwd.getpwuid(os.getuid()).pw_name
        rows = [row(j, info) for j in _queued_rows(user)
                for info in [job_summary(cfg, j["job_id"])] if show_all or info or j["note"]]
    if len(jobs) == 1 and fmt.kind == "text":
        _details(cfg, rows[0], fmt)
        return
    summaries = {r["job_id"]: job_summary(cfg, r["job_id"]) for r in rows} if fmt.kind == "json" else {}
    emit(fmt, COLUMNS, rows, [{**r, "summary": summaries.get(r["job_id"])} for r in rows])


def interval_lines(rec: dict[str, Any]) -> list[str]:
    """--checkpoint-interval=auto: the interval the job's coordinator chose and what from (summary.interval_record;
    `--json` has the same record as numbers, under "interval")."""
    if "interval_s" not in rec:
        return []
    told = rec.get("interruptions") or {}
    bounds = f"bounds {format_duration(rec.get('min_s', 0))}..{format_duration(rec.get('max_s', 0))}"
    if rec.get("bound"):
        where = rec.get("min_from") if rec["bound"] == "min_interval" else rec.get("max_from")
        bounds += f", set by {rec['bound']} of {shown(where or 'slurmckpt')}"
    if rec.get("basis") == "first":
        why = "auto_first_interval: no capture measured yet"
    else:
        stalls = " ".join(f"{s:.2f}" for s in rec.get("stalls", []))
        why = (f"Daly {rec.get('daly_s', 0):.0f}s (Young {rec.get('young_s', 0):.0f}s) for a stall of "
               f"{rec.get('stall_s', 0):.2f}s (median of {stalls or 'none'})")
    prior = f"interruption_mtbi {format_duration(int(told['prior_s']))}" if told.get("prior_s") else \
        "interruption_mtbi"
    if told.get("source") == "accounting":
        source = (f"accounting: {told.get('interruptions')} interruption(s) in {float(told.get('node_s') or 0) / 3600:.1f} "
                  f"node-hours of {told.get('runs')} run(s) of partition {shown(told.get('partition'))} over "
                  f"{format_duration(int(told.get('window_s') or 0))}, weighed with {prior}")
    else:
        source = prior + (" (accounting not answered yet)" if told.get("source") == "pending" else "")
    nodes = int(told.get("nodes") or 1)
    return [f"   Interval: auto {format_duration(rec['interval_s'])} chosen {when(rec.get('chosen_at'))}: {why}; {bounds}",
            f"   MTBI: {rec.get('mtbi_s', 0) / 3600:.2f}h for the job ({source}"
            + (f"; per node, {nodes} nodes" if nodes > 1 else "") + ")"]


def _details(cfg: Config, r: dict[str, Any], fmt: Format) -> None:
    info = job_summary(cfg, r["job_id"])
    array = f" ({shown(r['job'])})" if str(r["job"]) != str(r["job_id"]) else ""
    click.echo(f"JobId={r['job_id']}{array} User={shown(r['user'])} State={shown(r['state'])} "
               f"Restarts={'' if r['restarts'] is None else r['restarts']} Partition={shown(r['partition'])} "
               f"QOS={shown(r['qos'])} NodeList={shown(r['nodes'])}")
    if info is None:
        say(fmt, "   no checkpoint summary visible to you (not under slurmckpt, not your job, or no summary "
                 "written yet)")
    else:
        run = info.get("run") or {}
        if run:
            interval = run.get("interval_s") or 0
            click.echo(f"   Run: restart {run.get('restart_count')} started {when(run.get('started_at'))} on "
                       f"{shown(run.get('batch_node'))}, interval {format_interval(interval)}"
                       + (f", disabled: {shown(run['disabled'])}" if run.get("disabled") else ""))
        for line in interval_lines(info.get("interval") or {}):
            click.echo(line)
        for step, trade in (run.get("gpu_transports") or {}).items():    # cuda/nccl.py: the NCCL trade
            click.echo(f"   GPUs: step {shown(step)}: {shown(trade)}")
        epochs = info.get("epochs") or []
        click.echo("newest checkpoint: " + (f"epoch {epochs[0]['epoch']} ({shown(epochs[0]['trigger'])})"
                                            if epochs else "none committed"))
        if epochs:
            emit(Format("text"), EPOCH_COLUMNS,
                 [{**e, "committed": when(e["committed_at"]), "size": size_text(e["bytes"]),
                   "nodes": ",".join(e.get("nodes", []))} for e in epochs])
        gone = info.get("images_removed")
        if gone:
            click.echo(f"images removed: {when(gone.get('at'))} ({shown(gone.get('why'))}); the epochs above are "
                       "what the job had")
        for w in info.get("withdrawn") or []:
            click.echo(f"withdrawn: epoch {w.get('epoch')}: {shown(w.get('reason'))}")
        failed = (info.get("failed_captures") or [None])[0]
        if failed:
            f = CaptureFailure.from_dict(failed)
            click.echo(f"last failed capture: {shown(f.describe())} (node {shown(f.node or '?')}, stage "
                       f"{shown(f.stage)}, {when(f.at)})")
    if r.get("note"):
        click.echo(f"{r['note_field']}: {shown(r['note'])}")
