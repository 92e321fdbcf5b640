"""slurmckpt(1) and slurmckpt.yaml(5), built from the one source of each: the click commands (their usage,
help and options) and the Config dataclass (its keys, defaults and descriptions) with the policy's keys.
`python -m slurmckpt.cli.manpage DIR` writes DIR/slurmckpt.1 and DIR/slurmckpt.yaml.5 (make man)."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import click

from slurmckpt import __version__
from slurmckpt.config import Config, config_paths
from slurmckpt.duration import format_duration
from slurmckpt.policy import RULE_DOCS, SETTING_KEYS

# Reproducible builds: the date of the source (SOURCE_DATE_EPOCH, e.g. the last commit's), else today.
DATE = time.strftime("%Y-%m-%d", time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH") or time.time())))


def roff(text: str) -> str:
    """Text safe in a roff line: backslashes, leading dots/quotes, hyphens of options."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def _header(name: str, section: int, title: str) -> list[str]:
    # no hyphenation, ragged right: paths and option names stay whole
    return [f'.TH {name.upper()} {section} "{DATE}" "slurmckpt {__version__}" "{title}"', ".nh", ".ad l",
            ".SH NAME", f"{roff(name)}"]


def _command_section(path: list[str], command: click.Command) -> list[str]:
    ctx = click.Context(command, info_name=" ".join(path))
    out = [".SS " + roff(" ".join(path)), ".nf", roff(command.get_usage(ctx).removeprefix("Usage: ")), ".fi",
           ".PP", roff(" ".join((command.help or "").split()))]
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        record = param.get_help_record(ctx)
        if record:
            out += [".TP", ".B " + roff(record[0]), roff(record[1])]
    return out


def _commands(group: click.Group, prefix: list[str]) -> Iterator[tuple[list[str], click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        if isinstance(command, click.Group):
            yield from _commands(command, prefix + [name])
        else:
            yield prefix + [name], command


def page_cli() -> str:
    from slurmckpt.cli import cli
    lines = _header("slurmckpt", 1, "slurmckpt") + [
        "\\- checkpoint/restore of Slurm jobs: status, capture, requeue, migrate, policy, node check",
        ".SH SYNOPSIS", ".B slurmckpt", "[\\fB\\-h\\fR] [\\fB\\-V\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIJOB\\fR]",
        ".SH DESCRIPTION", roff(" ".join((cli.help or "").split())),
        ".PP", roff("JOB is a job id N, or N_M for task M of array job N (its own job id is looked up). Every "
                    "command takes -h/--help; those that print data take --json (one JSON document), -p/--parsable "
                    "(fields separated by |, one after the last), -P/--parsable2 (none after the last) and "
                    "-n/--noheader, as sacct does."),
        ".SH COMMANDS"]
    for path, command in _commands(cli, ["slurmckpt"]):
        lines += _command_section(path, command)
    lines += [".SH EXIT STATUS", roff("0 on success. 1 when the command fails: an unknown job (\"Invalid job id "
                                      "specified\", as squeue and scontrol say), a refusal, a failed check; the "
                                      "message is on stderr as 'slurmckpt: error: ...'. 2 for a bad command line."),
              ".SH ENVIRONMENT", ".TP", ".B SLURMCKPT_CONFIG",
              roff("The configuration file the user-side commands read first (see slurmckpt.yaml(5))."),
              ".TP", ".B SLURM_CONF", roff("The slurm.conf in use, as for Slurm's own commands."),
              ".SH FILES", ".TP", roff(str(config_paths()[0])), roff("The configuration (slurmckpt.yaml(5))."),
              ".SH SEE ALSO", "slurmckpt.yaml(5), sbatch(1), scontrol(1), squeue(1), sacct(1), spank(8)"]
    return "\n".join(lines) + "\n"


def _default(f: dataclasses.Field[Any]) -> str:
    if f.name == "policy":
        return "none"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]  # a key without a default has a factory (config._key)
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    if f.metadata.get("duration"):
        return format_duration(value)
    return str(value) if value != "" else '""'


def page_config() -> str:
    lines = _header("slurmckpt.yaml", 5, "slurmckpt") + [
        "\\- configuration of slurmckpt", ".SH DESCRIPTION",
        roff("A YAML mapping of the keys below; every key is optional and an unknown key, a key given twice or a "
             "bad value is an error that names it. The first file of this list that exists is read: "
             "$SLURMCKPT_CONFIG (user-side commands only), /etc/slurmckpt/slurmckpt.yaml, then slurmckpt.yaml next to "
             "the slurm.conf in use ($SLURM_CONF's directory, else /etc/slurm). The root agents read it without "
             "$SLURMCKPT_CONFIG and without environment overrides. Slurm's configless mode does not ship this file: "
             "put it on every node."),
        ".SH KEYS"]
    for f in dataclasses.fields(Config):
        if f.metadata.get("internal"):
            continue
        lines += [".TP", f".B {roff(f.name)}", roff(f"{f.metadata['doc']} Default: {_default(f)}.")]
    lines += [".SH POLICY", roff("policy: maps default, partitions (name: entry) and qos (name: entry) to entries "
                                 "with these keys. For a job, allowed: false anywhere, the largest min_interval and "
                                 "the smallest max_interval apply; default_interval and settings come from the QOS entry, else the partition "
                                 "entry, else default. sbatch checks it through cli_filter/lua (cli_filter.lua); the "
                                 "root agents apply it to running jobs.")]
    for key, doc in RULE_DOCS.items():
        lines += [".TP", f".B {roff(key)}", roff(doc)]
    known = {f.name for f in dataclasses.fields(Config)}
    for key in (k for k in SETTING_KEYS if k in known):
        lines += [".TP", f".B {roff(key)}", roff(f"The job's {key} (see KEYS).")]
    lines += [".SH EXAMPLE", ".nf", *(roff(line) for line in (
        "storage_root: /shared/slurmckpt/images", "summary_dir: /shared/slurmckpt/summaries", "keep_epochs: 2",
        "metrics_textfile: /var/lib/prometheus/node-exporter/slurmckpt.prom", "policy:",
        "  default: {min_interval: 5m}", "  partitions:", "    debug: {allowed: false}",
        "    preemptible: {default_interval: 30m, keep_epochs: 3}", "  qos:", "    long: {min_interval: 1h}")),
        ".fi", ".SH SEE ALSO", "slurmckpt(1), slurm.conf(5), spank(8)"]
    return "\n".join(lines) + "\n"


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = [directory / "slurmckpt.1", directory / "slurmckpt.yaml.5"]
    out[0].write_text(page_cli())
    out[1].write_text(page_config())
    return out


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "build/man")):
        print(path)
