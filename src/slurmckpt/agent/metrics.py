"""Prometheus metrics of one node, as a node_exporter textfile collector file (docs/operations.md, "Metrics").

Every task runs its own agent process, so the node's counters live in one root-only state file
(`<run_dir>/metrics-<node>.json`) that each agent updates under a POSIX lock; after each update the agent
renders the whole node's metrics into `metrics_textfile` by atomic rename (node_exporter never reads half a
file). Counters and histograms only grow (they restart from 0 when run_dir, a tmpfs, is emptied at boot,
which Prometheus reads as a counter reset). Gauges are per agent: an entry whose agent process is gone
(psutil: pid and start time) no longer counts.

Label values come from a fixed set (`Metric.values`): what a job chooses (a trigger or stage its own
coordinator names) is counted as "other" when it is none of them, so no job adds series. Labels the site
names (policy rules) keep at most MAX_LABEL_VALUES values each. The state file is read whole up to
MAX_STATE_BYTES and checked entry by entry; one that cannot be read back (too large, not JSON, not shaped
so) starts afresh, which Prometheus reads as a counter reset, rather than stopping every agent of the node.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from slurmckpt.coordinator.protocol import TRIGGERS

log = logging.getLogger("slurmckpt.metrics")

SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OTHER = "other"             # a label value outside the metric's set
MAX_LABEL_VALUES = 32       # values of a label the site names (past it: "other")
MAX_GAUGE_ENTRIES = 65536   # agents of a node that a gauge keeps (they are live processes)
MAX_STATE_BYTES = 8 << 20   # far above what the bounds above make: a larger state file is not ours
# The rank's stages and the coordinator's phases (rank/capture.py, coordinator/server.py; a unit test keeps
# them in step), and the triggers of captures (coordinator/protocol.py)
STAGES = ("check", "pmi-precheck", "space", "memory", "gpu-lock", "gpu-checkpoint", "freeze", "pmi-idle",
          "drain-output", "record", "host-copy", "dump", "snapshot-output", "handover", "persist", "window", "size",
          "prepare", "capture", "resume", "allocate", "membership", "commit")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str            # counter | gauge | histogram
    help: str
    label: str = ""      # the one label a counter is split by ("" = none)
    values: tuple[str, ...] = ()     # its values (any other counts as "other"); () = the site's, capped

    def label_value(self, value: str, present: dict[str, Any]) -> str:
        """`value` as this counter records it, given the values it has (`present`)."""
        if not self.label:
            return ""
        if self.values:
            return value if value in self.values else OTHER
        return value if value in present or len(present) - (OTHER in present) < MAX_LABEL_VALUES else OTHER


METRICS = (
    Metric("slurmckpt_captures_total", "counter", "Ranks captured on this node (images dumped), by trigger.",
           "trigger", (*TRIGGERS, OTHER)),
    Metric("slurmckpt_commits_total", "counter", "Checkpoint epochs committed by agents on this node (one per "
           "job and epoch), by trigger.", "trigger", (*TRIGGERS, OTHER)),
    Metric("slurmckpt_capture_failures_total", "counter", "Capture failures recorded by agents on this node, by "
           "the rank stage or coordinator phase that failed.", "stage", (*STAGES, OTHER)),
    Metric("slurmckpt_captured_bytes_total", "counter", "Bytes of checkpoint images written by ranks on this "
           "node."),
    Metric("slurmckpt_stall_seconds", "histogram", "How long a periodic capture stopped a rank's tree: from "
           "PREPARE (GPU lock, freeze) to RESUME (thaw)."),
    Metric("slurmckpt_restores_total", "counter", "Restores of a checkpoint on this node, by result (ok, "
           "failed).", "result", ("ok", "failed", OTHER)),
    Metric("slurmckpt_restore_seconds", "histogram", "Time to restore a rank from a committed checkpoint."),
    Metric("slurmckpt_policy_refusals_total", "counter", "Captures or tasks refused by the site policy, by "
           "rule.", "rule"),
    Metric("slurmckpt_persists_pending", "gauge", "Ranks on this node whose images are dumped but not yet "
           "persisted (sealed into the store)."),
    Metric("slurmckpt_agents", "gauge", "Tasks running under slurmckpt on this node (one root agent each)."),
    Metric("slurmckpt_metrics_updated_timestamp_seconds", "gauge", "When an agent last updated this file."),
)
BY_NAME = {m.name: m for m in METRICS}


def escape(value: str) -> str:
    """A label value as the text exposition format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) and not float(value).is_integer() else str(int(value))


def render(state: dict[str, Any], now: float, node: str, alive: Callable[[dict[str, Any]], bool] | None = None) -> str:
    """The text exposition format (version 0.0.4) of `state`, every metric with HELP and TYPE. Every sample
    carries `node` (the Slurm node): node_exporter merges the *.prom files of a directory, and nodes that share
    a host (and the directory) must not collide."""
    alive = alive or _agent_alive
    at = f'node="{escape(node)}"'
    lines: list[str] = []
    for m in METRICS:
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"]
        if m.kind == "counter":
            values = state.get("counters", {}).get(m.name, {})
            if not m.label:
                lines.append(f"{m.name}{{{at}}} {_number(values.get('', 0))}")
            for key, value in sorted(values.items()):
                if m.label and key:
                    lines.append(f'{m.name}{{{at},{m.label}="{escape(key)}"}} {_number(value)}')
        elif m.kind == "histogram":
            h = state.get("histograms", {}).get(m.name) or {"buckets": [0] * len(SECONDS_BUCKETS), "sum": 0.0,
                                                           "count": 0}
            for bound, count in zip(SECONDS_BUCKETS, h["buckets"]):
                lines.append(f'{m.name}_bucket{{{at},le="{bound}"}} {count}')
            lines += [f'{m.name}_bucket{{{at},le="+Inf"}} {h["count"]}', f"{m.name}_sum{{{at}}} {_number(h['sum'])}",
                      f"{m.name}_count{{{at}}} {h['count']}"]
        elif m.name == "slurmckpt_metrics_updated_timestamp_seconds":
            lines.append(f"{m.name}{{{at}}} {_number(round(now, 3))}")
        else:
            entries = state.get("gauges", {}).get(m.name, {})
            lines.append(f"{m.name}{{{at}}} {_number(sum(e['value'] for e in entries.values() if alive(e)))}")
    return "\n".join(lines) + "\n"


def _agent_alive(entry: dict[str, Any]) -> bool:
    """The agent that set a gauge entry still runs: same pid, same start time (no reused pid counts)."""
    try:
        return bool(abs(psutil.Process(entry["pid"]).create_time() - entry["started"]) < 0.01)
    except (psutil.Error, KeyError, TypeError):
        return False


def _own_entry(value: float) -> dict[str, Any]:
    me = psutil.Process()
    return {"value": value, "pid": me.pid, "started": me.create_time()}


def node_name() -> str:
    return socket.gethostname().split(".")[0]


class NodeMetrics:
    """One agent's handle on its node's metrics. Failures only log: metrics never fail a capture."""

    def __init__(self, textfile: str, state_dir: str, task: str, node: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        node = node or node_name()
        self.textfile = Path(textfile.replace("%n", node)) if textfile else None
        self.state = Path(state_dir) / f"metrics-{node}.json"
        self.task, self.node, self.clock = task, node, clock

    def count(self, name: str, label: str = "", by: float = 1) -> None:
        def change(state: dict[str, Any]) -> None:
            counters = state.setdefault("counters", {}).setdefault(name, {})
            key = BY_NAME[name].label_value(label, counters)
            counters[key] = counters.get(key, 0) + by
        self._update(name, change)

    def observe(self, name: str, seconds: float) -> None:
        def change(state: dict[str, Any]) -> None:
            h = state.setdefault("histograms", {}).setdefault(
                name, {"buckets": [0] * len(SECONDS_BUCKETS), "sum": 0.0, "count": 0})
            h["buckets"] = [c + (seconds <= b) for c, b in zip(h["buckets"], SECONDS_BUCKETS)]
            h["sum"] = round(h["sum"] + seconds, 6)
            h["count"] += 1
        self._update(name, change)

    def gauge(self, name: str, value: float | None) -> None:
        """This agent's part of a gauge (None: it takes no part any more)."""
        def change(state: dict[str, Any]) -> None:
            entries = state.setdefault("gauges", {}).setdefault(name, {})
            if value is None:
                entries.pop(self.task, None)
            else:
                entries[self.task] = _own_entry(value)
            for key in [k for k, e in entries.items() if not _agent_alive(e)]:
                del entries[key]            # agents that died without saying so
        self._update(name, change)

    def _update(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        if name not in BY_NAME:
            raise ValueError(f"unknown metric {name}")
        try:
            with self._locked() as state:
                change(state)
                if self.textfile:
                    publish(self.textfile, render(state, self.clock(), self.node))
        except (OSError, ValueError) as e:
            log.warning("metrics not updated (%s): %s", name, e)

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.state.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(self.state, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            state = _read_state(fd, self.state)
            yield state
            data = json.dumps(state, sort_keys=True).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
        finally:
            os.close(fd)


def _read_state(fd: int, path: Path) -> dict[str, Any]:
    """The node's state from the locked file: whole, and only what `_checked` keeps; {} (and a warning)
    when it cannot be read back, so that the next update starts afresh instead of failing forever."""
    size = os.fstat(fd).st_size
    if size > MAX_STATE_BYTES:
        log.warning("metrics state %s is %d bytes, more than slurmckpt writes: starting afresh", path, size)
        return {}
    raw = b""
    while chunk := os.read(fd, 1 << 20):
        raw += chunk
    try:
        state = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as e:
        log.warning("metrics state %s unreadable (%s): starting afresh", path, e)
        return {}
    return _checked(state)


def _number_or_none(value: object) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def _checked(state: object) -> dict[str, Any]:
    """Known metrics only, each shaped as this module writes it and within its bounds."""
    if not isinstance(state, dict):
        return {}
    out: dict[str, Any] = {"counters": {}, "histograms": {}, "gauges": {}}
    for name, values in (state.get("counters") or {}).items() if isinstance(state.get("counters"), dict) else ():
        m = BY_NAME.get(name)
        if m is None or m.kind != "counter" or not isinstance(values, dict):
            continue
        kept: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(key, str) and _number_or_none(value) is not None:
                key = m.label_value(key, kept) if m.label else ""
                kept[key] = kept.get(key, 0) + value
        out["counters"][name] = kept
    for name, h in (state.get("histograms") or {}).items() if isinstance(state.get("histograms"), dict) else ():
        m = BY_NAME.get(name)
        if (m and m.kind == "histogram" and isinstance(h, dict) and isinstance(h.get("buckets"), list)
                and len(h["buckets"]) == len(SECONDS_BUCKETS) and all(type(c) is int for c in h["buckets"])
                and type(h.get("count")) is int and _number_or_none(h.get("sum")) is not None):
            out["histograms"][name] = {"buckets": h["buckets"], "sum": h["sum"], "count": h["count"]}
    for name, entries in (state.get("gauges") or {}).items() if isinstance(state.get("gauges"), dict) else ():
        m = BY_NAME.get(name)
        if m is None or m.kind != "gauge" or not isinstance(entries, dict):
            continue
        out["gauges"][name] = dict(list(
            (task, e) for task, e in entries.items()
            if isinstance(task, str) and isinstance(e, dict) and _number_or_none(e.get("value")) is not None
            and type(e.get("pid")) is int and _number_or_none(e.get("started")) is not None)[-MAX_GAUGE_ENTRIES:])
    return out


def publish(path: Path, text: str) -> None:
    """Atomic: node_exporter reads either the previous file or this one, never a part."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)     # node_exporter may run as its own user (Debian: prometheus)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)


def read_state(state_dir: str, node: str | None = None) -> dict[str, Any]:
    """For `slurmckpt metrics`: the node's state as last written (empty when no agent ran here)."""
    path = Path(state_dir) / f"metrics-{node or node_name()}.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    try:
        return _read_state(fd, path)
    finally:
        os.close(fd)
