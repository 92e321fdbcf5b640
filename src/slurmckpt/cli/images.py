"""`slurmckpt list | inspect` (root): what the image store holds. The store is root-only (0700); users see
their own jobs' checkpoints through `slurmckpt status` (the job summaries, summary.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import click

from slurmckpt.cli.lookup import JOB, config, queued
from slurmckpt.cli.output import CliError, Column, Format, emit, output_options, shown, took, when
from slurmckpt.config import Config
from slurmckpt.slurm.jobref import JobRef
from slurmckpt.store.jobstore import JobStore, list_jobs
from slurmckpt.store.record import RankRecord
from slurmckpt.sizes import size_text
from slurmckpt import validate

LIST_COLUMNS = [Column("cluster", "CLUSTER"), Column("job", "JOBID", right=True), Column("epoch", "EPOCH", right=True),
                Column("reason", "TRIGGER"), Column("ranks", "RANKS", right=True), Column("committed", "COMMITTED")]


def store_root(cfg: Config) -> Path:
    root = Path(cfg.storage_root)
    if not os.access(root, os.R_OK | os.X_OK):
        raise CliError(f"{root} is readable by root only (images belong to root); run as root, or see your "
                       "jobs' checkpoints with `slurmckpt status`")
    return root


@click.command(name="list")
@output_options
def list_cmd(fmt: Format) -> None:
    """(root) Committed checkpoints of every job in the image store."""
    root = store_root(config())
    rows = []
    for cluster, job in list_jobs(root):
        for e in JobStore(root, cluster, job).committed():
            rows.append({"cluster": cluster, "job": job, "epoch": e["epoch"], "reason": e["reason"],
                         "ranks": len(e["ranks"]), "committed_at": e["committed_at"],
                         "committed": when(e["committed_at"])})
    emit(fmt, LIST_COLUMNS, rows)


def _job_id(ref: JobRef) -> int:
    """N as written; an array task's own id through Slurm."""
    return ref.job if ref.task is None else queued(ref).job_id


@click.command()
@click.argument("job", type=JOB)
@click.option("--epoch", type=int, default=None, help="Default: the newest committed one.")
@output_options
def inspect(job: JobRef, epoch: int | None, fmt: Format) -> None:
    """(root) What a checkpoint holds: ranks, processes, files, output snapshots, sizes, timings."""
    root = store_root(config())
    job_id = _job_id(job)
    clusters = [c for c, j in list_jobs(root) if j == job_id]
    if not clusters:
        raise CliError(f"no checkpoint of job {job_id} in {root}")
    store = JobStore(root, clusters[0], job_id)
    chosen = next((e for e in store.committed() if epoch in (None, e["epoch"])), None)
    if chosen is None:
        raise CliError(f"job {job_id} has no committed epoch {epoch}")
    ranks, records = {}, {}       # the job manifest's entry (with rank.json's fields for --json); rank.json
    for name, entry in sorted(chosen["ranks"].items()):
        if entry["kind"] != "completed":
            step, rank = validate.rank_name(name)
            records[name] = store.read_rank_manifest(chosen["epoch"], step, rank)
            entry = {**entry, **records[name].to_json()}
        ranks[name] = entry
    if fmt.kind == "json":
        emit(fmt, [], [], {"job": job_id, "cluster": clusters[0], "epoch": chosen["epoch"],
                           "reason": chosen["reason"], "committed_at": chosen["committed_at"], "ranks": ranks})
        return
    if fmt.kind != "text":
        emit(fmt, [Column("rank", "RANK"), Column("kind", "KIND"), Column("node", "NODE"),
                   Column("processes", "PROCESSES"), Column("bytes", "BYTES"), Column("files", "FILES")],
             [_row(n, r, records.get(n)) for n, r in ranks.items()])
        return
    click.echo(f"job {job_id} epoch {chosen['epoch']} ({shown(chosen['reason'])}), {len(ranks)} rank(s)")
    for name, m in ranks.items():
        rec = records.get(name)
        if rec is None:
            click.echo(f"  {shown(name)}: completed before the capture, exit code {shown(m['exit_code'])}")
            continue
        c = rec.capture
        click.echo(f"  {shown(name)}: {shown(c.tree.kind)} on {shown(c.tree.node)}, {shown(c.tree.processes)} "
                   f"process(es), {size_text(rec.seal.stored_bytes())} stored ({size_text(rec.seal.raw_bytes())} "
                   f"raw) in {len(rec.seal.files)} file(s), uid {shown(c.tree.uid)}")
        for o in c.outputs:
            click.echo(f"    output fd {shown(o.fd)}: {shown(o.link)} ({shown(o.size)} B snapshot)")
        for t in c.files.truncate:
            click.echo(f"    written file: {shown(t.path)} at {shown(t.size)} B")
        if c.gpu.state:
            click.echo(f"    gpu: {json.dumps(c.gpu.state)}")
        click.echo(f"    timings: {timings(c.timings)}")


def _row(name: str, entry: dict[str, Any], rec: RankRecord | None) -> dict[str, Any]:
    if rec is None:        # a task completed before the capture: the job manifest's entry alone
        return {"rank": name, "kind": entry.get("kind"), "node": entry.get("node"),
                "processes": entry.get("processes"), "bytes": 0, "files": 0}
    return {"rank": name, "kind": rec.capture.tree.kind, "node": rec.capture.tree.node,
            "processes": rec.capture.tree.processes, "bytes": rec.seal.stored_bytes(), "files": len(rec.seal.files)}


def timings(recorded: Mapping[str, Any]) -> str:
    """A rank's stage timings as people read them, `criu_dump 0.06 s, ...`, then the `*_mib` entries (sizes
    the stages measured) through the one size formatter. `--json` keeps the numbers."""
    times, sizes = [], []
    for name, value in recorded.items():
        if type(value) not in (int, float):
            times.append(f"{shown(name)} {shown(value)}")
        elif name.endswith("_mib"):
            sizes.append(f"{shown(name.removesuffix('_mib'))} {size_text(round(value * 2**20))}")
        else:
            times.append(f"{shown(name)} {took(value)}")
    return ", ".join(times + sizes) or "none recorded"
