"""`slurmckpt env`: this run's Slurm variables, for a program restored from a checkpoint (slurm/run_env.py)."""
from __future__ import annotations

import click

from slurmckpt.cli.output import CliError, Column, Format, emit, output_options
from slurmckpt.errors import SlurmckptError

COLUMNS = (Column("name", "NAME"), Column("value", "VALUE"))


@click.command("env")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@output_options
def env(names: tuple[str, ...], fmt: Format) -> None:
    """Print this run's SLURM_* and SLURMD_* variables (a restored program's own are its first run's).

    The variables of the task's current run, as its slurmckpt wrapper got them from Slurm: NAME=value lines,
    or with NAMEs their values alone, one a line (exit 1 if one is unset, like printenv); -p/-P a NAME|VALUE
    table, --json one object. A process restored from a checkpoint keeps the environment it was captured with
    (an earlier run's SLURM_RESTART_COUNT, SLURM_JOB_SLUID, SLURMD_NODENAME...); this reads the current one,
    e.g. `SLUID=$(slurmckpt env SLURM_JOB_SLUID)` in a restored batch script."""
    from slurmckpt.slurm.run_env import current_run
    try:
        values = current_run()
    except SlurmckptError as e:
        raise CliError(str(e)) from e
    unset = [n for n in names if n not in values]
    if unset and fmt.kind != "json":
        raise CliError(f"not set in this run's environment: {' '.join(unset)}")
    if fmt.kind == "json":
        emit(fmt, COLUMNS, [], {n: values.get(n) for n in names} if names else values)
    elif fmt.kind == "text":
        for name in names or values:
            click.echo(values[name] if names else f"{name}={values[name]}")
    else:
        emit(fmt, COLUMNS, [{"name": n, "value": values[n]} for n in (names or values)])
