"""Where a root agent's log goes (docs/operations.md, "Logs"): `log_target: file` (default) writes one file per
task, `<log_dir>/agent-<job>.<step>.<rank>.log`, rotated by size (`log_max_bytes`, `log_backups`), and every
agent start removes the files of tasks older than `log_keep_days`; `log_target: syslog` sends the records to
`syslog_address` (/dev/log, which journald reads on systemd hosts) with the tag `slurmckpt-agent`.
Every record names job, step, rank and pid, and is one line of printable text: records carry strings the
job's user chose (argv[0], paths, criu's log of the user's files), so the formatter (`OneLine`) escapes
every control character, newlines included (`escape`): no user string forges a record.
"""
from __future__ import annotations

import dataclasses
import logging
import logging.handlers
import os
import socket
import stat
import time
from pathlib import Path

from slurmckpt.config import Config

FORMAT = "%(name)s job={job} step={step} rank={rank} pid=%(process)d %(levelname)s %(message)s"


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """`text` as one line of printable characters: newline, carriage return and tab as \\n \\r \\t, any other
    character Python does not print (C0/C1 controls, DEL, escape sequences, line separators, bidi overrides)
    as \\xNN, \\uNNNN or \\UNNNNNNNN."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else
                   f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}") for c in text)


class OneLine(logging.Formatter):
    """Each record, its traceback included, as one escaped line (`escape`)."""

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record))


def task_log_path(config: Config, job: int, step: str, rank: int) -> Path:
    return Path(config.log_dir) / f"agent-{job}.{step}.{rank}.log"


def handler_for(config: Config, job: int, step: str, rank: int) -> logging.Handler:
    fields = FORMAT.format(job=job, step=step, rank=rank)
    if config.log_target == "syslog":
        try:
            _reachable(config.syslog_address)
            handler: logging.Handler = logging.handlers.SysLogHandler(
                address=config.syslog_address, facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        except OSError as e:        # no syslog daemon: the file, with a record saying why
            handler = handler_for(dataclasses.replace(config, log_target="file"), job, step, rank)
            handler.handle(logging.makeLogRecord({"name": "slurmckpt.agent", "levelname": "WARNING",
                                                  "levelno": logging.WARNING, "process": os.getpid(),
                                                  "msg": f"syslog at {config.syslog_address} unreachable ({e}); "
                                                         "logging to this file"}))
            return handler
        handler.ident = "slurmckpt-agent: "  # type: ignore[attr-defined]  # SysLogHandler's prefix, typeshed omits it
        handler.setFormatter(OneLine(fields))
        return handler
    Path(config.log_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(task_log_path(config, job, step, rank),
                                                   maxBytes=config.log_max_bytes, backupCount=config.log_backups)
    handler.setFormatter(OneLine("%(asctime)s " + fields))
    return handler


def _reachable(address: str) -> None:
    """SysLogHandler ignores an unreachable socket (its records would vanish): try it first, as it does."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_UNIX, kind) as s:
            try:
                s.connect(address)
                return
            except OSError as e:
                error = e
    raise error


def remove_old(config: Config, now: float | None = None) -> list[str]:
    """Agent log files (and their rotated copies) not written for log_keep_days. Only regular files named
    like ours, in the root-only log directory."""
    if config.log_target != "file" or config.log_keep_days <= 0:
        return []
    limit = (now or time.time()) - config.log_keep_days * 86400
    removed = []
    try:
        entries = list(os.scandir(config.log_dir))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith("agent-") and ".log" in entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < limit:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
    return removed


def setup(config: Config, job: int, step: str, rank: int) -> None:
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler_for(config, job, step, rank))
    root.setLevel(logging.INFO)
    removed = remove_old(config)
    if removed:
        logging.getLogger("slurmckpt.agent").info("removed %d agent log file(s) older than %d days", len(removed),
                                                  config.log_keep_days)
