"""How every `slurmckpt` subcommand prints, the way Slurm's tools do: a table by default; `-p/--parsable`
(fields joined by '|', one after the last, like `sacct -p`); `-P/--parsable2` (no '|' at the end, `sacct -P`);
`-n/--noheader`; `--json` (one document on stdout). Errors go to stderr as `slurmckpt: error: ...` with exit
code 1, like scontrol's; a bad command line is click's usage error, exit code 2.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, IO, Sequence

import click


class CliError(click.ClickException):
    """What the user did or asked that cannot be done: one line on stderr, exit code 1."""
    exit_code = 1

    def show(self, file: IO[Any] | None = None) -> None:  # noqa: D102 - click's hook
        click.echo(f"slurmckpt: error: {self.format_message()}", err=True)


class JobNotFoundError(CliError):
    """A job id Slurm does not know: squeue's and scontrol's words ("Invalid job id specified")."""

    def __init__(self, spec: str) -> None:
        super().__init__(f"Invalid job id specified: {spec}")


def shown(value: object) -> str:
    """What a user wrote (argv, a path, a reason), safe for a terminal: control characters and escape
    sequences come out escaped, repr-style; plain printable text as it is."""
    text = value if isinstance(value, str) else str(value)
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    width: int = 0          # 0: as wide as the longest value (text format only)
    right: bool = False


@dataclass(frozen=True)
class Format:
    kind: str = "text"      # text | parsable | parsable2 | json
    header: bool = True

    @property
    def quiet(self) -> bool:
        """Machine formats carry data only: no human messages on stdout."""
        return self.kind != "text"


def output_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--json, -p/--parsable, -P/--parsable2, -n/--noheader; the command gets `fmt: Format`."""
    @click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
    @click.option("-p", "--parsable", is_flag=True, help="Fields separated by '|', with a '|' at the end.")
    @click.option("-P", "--parsable2", is_flag=True, help="Fields separated by '|', none at the end.")
    @click.option("-n", "--noheader", is_flag=True, help="No header line.")
    @functools.wraps(f)
    def wrapper(*args: Any, as_json: bool, parsable: bool, parsable2: bool, noheader: bool, **kw: Any) -> Any:
        if sum((as_json, parsable, parsable2)) > 1:
            raise click.UsageError("--json, --parsable and --parsable2 exclude each other")
        kind = "json" if as_json else "parsable" if parsable else "parsable2" if parsable2 else "text"
        return f(*args, fmt=Format(kind, not noheader), **kw)
    return wrapper


def emit(fmt: Format, columns: Sequence[Column], rows: Sequence[dict[str, Any]], document: object | None = None) -> None:
    """Rows as a table / '|'-separated lines, or `document` (default: the rows) as JSON."""
    if fmt.kind == "json":
        click.echo(json.dumps(rows if document is None else document, indent=2, sort_keys=True, default=str))
        return
    cells = [[shown("" if r.get(c.key) is None else r.get(c.key)) for c in columns] for r in rows]
    if fmt.kind in ("parsable", "parsable2"):
        end = "|" if fmt.kind == "parsable" else ""
        lines = ([[c.header for c in columns]] if fmt.header else []) + cells
        for line in lines:
            click.echo("|".join(v.replace("|", "\\|") for v in line) + end)
        return
    widths = [c.width or max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ([[c.header for c in columns]] if fmt.header else []) + cells
    for line in lines:
        click.echo(" ".join((v.rjust(w) if c.right else v.ljust(w)) for v, w, c in zip(line, widths, columns))
                   .rstrip())


def say(fmt: Format, text: str) -> None:
    """A human message: on stdout in text format, on stderr otherwise (stdout carries only the data)."""
    click.echo(text, err=fmt.quiet)


def took(seconds: float) -> str:
    """A duration as people read one: 0.06 s, 12.3 s, then the interval grammar's 2m5s (duration.py)."""
    from slurmckpt.duration import format_duration
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return format_duration(round(seconds))


def when(at: object) -> str:
    """A time stamp as Slurm's tools print one (local time, no zone), "" when there is none."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(float(at))) if isinstance(at, (int, float)) else ""
