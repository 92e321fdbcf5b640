"""`slurmckpt policy show | check`: the site policy of slurmckpt.yaml (policy.py) as it applies to a partition
and QOS. `check` is what Slurm's cli_filter/lua runs at submission (etc/cli_filter.lua): it prints `ok`, or
`refused: MESSAGE` naming the option, on stdout (exit code 1), which sbatch/salloc/srun then print as their
error. The root agent applies the same policy to the running job whatever the submission did."""
from __future__ import annotations

import click

from slurmckpt.cli.lookup import SQUEUE_TIMEOUT_S, config
from slurmckpt.cli.output import Column, Format, emit, output_options
from slurmckpt.duration import format_interval, parse_interval
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.control import CliSlurm


@click.group()
def policy() -> None:
    """The site's checkpoint policy per partition and QOS (slurmckpt.yaml, `policy:`)."""


def _partitions(value: str | None) -> list[str]:
    if value:
        return [p for p in value.split(",") if p]
    try:
        found = CliSlurm(timeout_s=SQUEUE_TIMEOUT_S).default_partition()
    except SlurmError:
        found = None
    return [found] if found else []


CHECK_COLUMNS = [Column("result", "RESULT"), Column("message", "MESSAGE")]


@policy.command()
@click.option("--interval", "value", required=True, help="The job's --checkpoint-interval value.")
@click.option("--partition", help="The job's --partition (comma-separated list); default: Slurm's default one.")
@click.option("--qos", help="The job's --qos.")
@output_options
def check(value: str, partition: str | None, qos: str | None, fmt: Format) -> None:
    """Would the policy accept `--checkpoint-interval=VALUE` in PARTITION with QOS? (cli_filter's question:
    it prints `ok`, or `refused: MESSAGE` with exit code 1)"""
    cfg = config()
    try:
        refusal = cfg.policy.for_job(_partitions(partition) if cfg.policy.partitions else [], qos).refusal(
            parse_interval(value))
        message = f"slurmckpt: {refusal}; see `slurmckpt policy show`" if refusal else ""
    except ValueError as e:
        refusal, message = str(e), str(e)
    if fmt.kind == "text":
        click.echo(f"refused: {message}" if refusal else "ok")
    else:
        emit(fmt, CHECK_COLUMNS, [{"result": "refused" if refusal else "ok", "message": message}],
             {"ok": not refusal, "message": message or None})
    if refusal:
        raise SystemExit(1)


COLUMNS = [Column("scope", "SCOPE"), Column("allowed", "ALLOWED"), Column("default_interval", "DEFAULT_INTERVAL"),
           Column("min_interval", "MIN_INTERVAL"), Column("max_interval", "MAX_INTERVAL"), Column("settings", "SETTINGS")]


def _interval(seconds: int | None) -> str:
    return "" if seconds is None else format_interval(seconds)


@policy.command()
@click.option("--partition", help="Resolve for this partition.")
@click.option("--qos", help="Resolve for this QOS.")
@output_options
def show(partition: str | None, qos: str | None, fmt: Format) -> None:
    """Every policy entry, or with --partition/--qos what applies to such a job."""
    pol = config().policy
    if partition or qos:
        job = pol.for_job([partition] if partition else [], qos)
        row = {"scope": f"partition {partition or '-'}, QOS {qos or '-'}", "allowed": job.allowed,
               "default_interval": _interval(job.default_interval), "min_interval": _interval(job.min_interval or None),
               "max_interval": _interval(job.max_interval),
               "settings": ",".join(f"{k}={v}" for k, v in job.settings.items())}
        emit(fmt, COLUMNS, [row], job.describe())
        return
    rules = [pol.default, *pol.partitions.values(), *pol.qos.values()]
    rows = [{"scope": r.name, "allowed": "" if r.allowed is None else r.allowed,
             "default_interval": _interval(r.default_interval), "min_interval": _interval(r.min_interval),
             "max_interval": _interval(r.max_interval),
             "settings": ",".join(f"{k}={v}" for k, v in r.settings.items())} for r in rules]
    emit(fmt, COLUMNS, rows)
