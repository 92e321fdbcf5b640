"""Prometheus metrics of one node, as a node_exporter textfile collector file (docs/operations.md, "Metrics").

Every task runs its own agent process, so the node's counters live in one root-only state file
(`<run_dir>/metrics-<node>.json`) that each agent updates under a POSIX lock; after each update the agent
renders the whole node's metrics into `metrics_textfile` by atomic rename (node_exporter never reads half a
file). Counters and histograms only grow (they restart from 0 when run_dir, a tmpfs, is emptied at boot,
which Prometheus reads as a counter reset). Gauges are per agent: an entry whose agent process is gone
(psutil: pid and start time) no longer counts.
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
from typing import Iterator

import psutil

log = logging.getLogger("slurmckpt.metrics")

SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str            # counter | gauge | histogram
    help: str
    label: str = ""      # the one label a counter is split by ("" = none)


METRICS = (
    Metric("slurmckpt_captures_total", "counter", "Ranks captured on this node (images dumped), by trigger.",
           "trigger"),
    Metric("slurmckpt_commits_total", "counter", "Checkpoint epochs committed by agents on this node (one per "
           "job and epoch), by trigger.", "trigger"),
    Metric("slurmckpt_capture_failures_total", "counter", "Capture failures recorded by agents on this node, by "
           "the pipeline stage or coordinator phase that failed.", "stage"),
    Metric("slurmckpt_captured_bytes_total", "counter", "Bytes of checkpoint images written by ranks on this "
           "node."),
    Metric("slurmckpt_stall_seconds", "histogram", "How long a periodic capture stopped a rank's tree: from "
           "PREPARE (GPU lock, freeze) to RESUME (thaw)."),
    Metric("slurmckpt_restores_total", "counter", "Restores of a checkpoint on this node, by result (ok, "
           "failed).", "result"),
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


def render(state: dict, now: float, node: str, alive=None) -> str:
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


def _agent_alive(entry: dict) -> bool:
    """The agent that set a gauge entry still runs: same pid, same start time (no reused pid counts)."""
    try:
        return abs(psutil.Process(entry["pid"]).create_time() - entry["started"]) < 0.01
    except (psutil.Error, KeyError, TypeError):
        return False


def _own_entry(value: float) -> dict:
    me = psutil.Process()
    return {"value": value, "pid": me.pid, "started": me.create_time()}


def node_name() -> str:
    return socket.gethostname().split(".")[0]


class NodeMetrics:
    """One agent's handle on its node's metrics. Failures only log: metrics never fail a capture."""

    def __init__(self, textfile: str, state_dir: str, task: str, node: str | None = None,
                 clock=time.time) -> None:
        node = node or node_name()
        self.textfile = Path(textfile.replace("%n", node)) if textfile else None
        self.state = Path(state_dir) / f"metrics-{node}.json"
        self.task, self.node, self.clock = task, node, clock

    def count(self, name: str, label: str = "", by: float = 1) -> None:
        def change(state: dict) -> None:
            counters = state.setdefault("counters", {}).setdefault(name, {})
            counters[label] = counters.get(label, 0) + by
        self._update(name, change)

    def observe(self, name: str, seconds: float) -> None:
        def change(state: dict) -> None:
            h = state.setdefault("histograms", {}).setdefault(
                name, {"buckets": [0] * len(SECONDS_BUCKETS), "sum": 0.0, "count": 0})
            h["buckets"] = [c + (seconds <= b) for c, b in zip(h["buckets"], SECONDS_BUCKETS)]
            h["sum"] = round(h["sum"] + seconds, 6)
            h["count"] += 1
        self._update(name, change)

    def gauge(self, name: str, value: float | None) -> None:
        """This agent's part of a gauge (None: it takes no part any more)."""
        def change(state: dict) -> None:
            entries = state.setdefault("gauges", {}).setdefault(name, {})
            if value is None:
                entries.pop(self.task, None)
            else:
                entries[self.task] = _own_entry(value)
            for key in [k for k, e in entries.items() if not _agent_alive(e)]:
                del entries[key]            # agents that died without saying so
        self._update(name, change)

    def _update(self, name: str, change) -> None:
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
    def _locked(self) -> Iterator[dict]:
        self.state.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(self.state, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            raw = os.read(fd, 1 << 22)
            state = json.loads(raw) if raw.strip() else {}
            yield state
            data = json.dumps(state, sort_keys=True).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
        finally:
            os.close(fd)


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


def read_state(state_dir: str, node: str | None = None) -> dict:
    """For `slurmckpt metrics`: the node's state as last written (empty when no agent ran here)."""
    try:
        return json.loads((Path(state_dir) / f"metrics-{node or node_name()}.json").read_text() or "{}")
    except FileNotFoundError:
        return {}
