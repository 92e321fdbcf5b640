"""How often a partition's jobs are interrupted, for --checkpoint-interval=auto (docs/operations.md,
"Automatic interval"): read by the root agent from accounting, cached per node.

Young (1974) and Daly (2006) choose the interval from M, the job's mean time between interruptions. The
agent of the task that hosts the job's coordinator reads the runs of the partition's jobs of the last
`interruption_window` from accounting (slurm/control.py `partition_runs`: every run, requeued ones each;
state, elapsed seconds and node count, fields no user writes), counts the runs that ended in one of
`interruption_states` and sums their node time. A node failure hits a job once per node it holds, so M is
per node and divided by the job's node count. Too little history is handled by weighing it against the
site's `interruption_mtbi` as if that were one interruption seen after that much node time (the posterior
mean of a Gamma prior on the rate): with no history M is the site's value, with much history it is what
accounting saw.

    node M = (node time + interruption_mtbi) / (interruptions + 1);   job M = node M / job's nodes

Root queries, not the job's coordinator: root sees every user's jobs whatever PrivateData says, one answer
serves every job of the partition on the node (cached in <run_dir>/interruptions/, root-only, an hour; a
failed query ten minutes), and the query runs in a thread of its own under a non-blocking node-wide lock, so
neither the agent nor the job ever waits for slurmdbd: until the answer is there the coordinator is told the
site's value.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from slurmckpt.errors import SlurmckptError

log = logging.getLogger("slurmckpt.interruptions")

CACHE_S = 3600.0                 # an answer serves the node's jobs of the partition this long
FAILED_CACHE_S = 600.0           # a failed query is retried after this long
PRIOR_WEIGHT = 1.0               # interruption_mtbi counts as this many interruptions
MAX_ROWS = 1_000_000             # runs read from one answer; the rest is left out (and said)
QUERY_TIMEOUT_S = 60.0           # sacct's limit (in a thread of its own: nothing waits for it)
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

Runs = list[tuple[str, int, int]]                 # (state word, elapsed seconds, nodes) per run
Query = Callable[[str, int], Runs]                # (partition, window seconds) -> runs; raises SlurmckptError


@dataclass(frozen=True)
class History:
    """What accounting said of a partition's runs over `window_s` before `measured_at` (time.time())."""
    partition: str
    interruptions: int
    node_s: float                 # node time of every run in the window (elapsed x nodes)
    runs: int
    window_s: int
    measured_at: float
    error: str = ""               # the query failed: nothing was measured

    def node_mtbi(self, prior_s: float) -> float:
        return (self.node_s + PRIOR_WEIGHT * prior_s) / (self.interruptions + PRIOR_WEIGHT)

    @classmethod
    def from_dict(cls, d: object) -> History | None:
        """A cache file's content, each field of its type (the file is root's; still checked)."""
        if not isinstance(d, dict):
            return None
        try:
            h = cls(str(d["partition"]), int(d["interruptions"]), float(d["node_s"]), int(d["runs"]),
                    int(d["window_s"]), float(d["measured_at"]), str(d.get("error", "")))
        except (KeyError, TypeError, ValueError):
            return None
        return h if h.interruptions >= 0 and h.node_s >= 0 and h.runs >= 0 else None


def tally(partition: str, runs: Runs, states: tuple[str, ...], window_s: int, now: float) -> History:
    counted = set(states)
    interruptions, node_s = 0, 0.0
    for state, elapsed, nodes in runs[:MAX_ROWS]:
        node_s += max(0, elapsed) * max(1, nodes)
        interruptions += state in counted
    if len(runs) > MAX_ROWS:
        log.warning("partition %s: %d runs in %d s of accounting, only the first %d counted", partition, len(runs),
                    window_s, MAX_ROWS)
    return History(partition, interruptions, node_s, min(len(runs), MAX_ROWS), window_s, now)


class PartitionHistory:
    """One partition's history as this node knows it: the cache file, refreshed in the background."""

    def __init__(self, cache_dir: Path, cluster: str, partition: str, window_s: int, states: tuple[str, ...],
                 query: Query, clock: Callable[[], float] = time.time) -> None:
        self.partition, self.window_s, self.states, self.query, self.clock = partition, window_s, states, query, clock
        name = f"{cluster}.{partition}"
        self.path = cache_dir / f"{name}.json" if SAFE_NAME.fullmatch(name) and window_s > 0 and partition else None
        self._thread: threading.Thread | None = None

    def current(self) -> tuple[History | None, bool]:
        """(the newest history this node has, or None; whether a refresh is under way). Never waits: a
        missing or stale answer starts a refresh in a thread of its own."""
        if self.path is None:
            return None, False
        cached = self._read()
        if cached is not None and self.clock() - cached.measured_at < (FAILED_CACHE_S if cached.error else CACHE_S):
            return cached, False
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.refresh, name="interruptions", daemon=True)
            self._thread.start()
        return cached, True

    def refresh(self) -> History | None:
        """Ask accounting and write the cache, unless another agent of this node is asking right now (its
        answer will be in the cache). None: not asked."""
        assert self.path is not None
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        lock = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            started = self.clock()
            try:
                history = tally(self.partition, self.query(self.partition, self.window_s), self.states,
                                self.window_s, started)
            except SlurmckptError as e:
                log.warning("partition %s: no interruption history from accounting: %s", self.partition, e)
                history = History(self.partition, 0, 0.0, 0, self.window_s, started, error=str(e)[:500])
            log.info("partition %s: %d interruption(s) in %.0f node-hours of %d run(s) over %d s (asked in %.1fs)",
                     self.partition, history.interruptions, history.node_s / 3600, history.runs, self.window_s,
                     self.clock() - started)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(asdict(history)))
            os.replace(tmp, self.path)
            return history
        except OSError as e:
            log.warning("partition %s: interruption history not cached: %s", self.partition, e)
            return None
        finally:
            os.close(lock)

    def _read(self) -> History | None:
        assert self.path is not None
        try:
            return History.from_dict(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            return None


def answer(history: History | None, pending: bool, prior_s: float, nodes: int, window_s: int) -> dict[str, Any]:
    """What the coordinator gets (agent op `interruptions`): the job's M and where it comes from."""
    nodes = max(1, nodes)
    base = {"prior_s": prior_s, "nodes": nodes, "window_s": window_s}
    if history is None or history.error:
        source = "pending" if pending else "default"
        out = {**base, "source": source, "node_mtbi_s": prior_s, "mtbi_s": prior_s / nodes}
        if history is not None:
            out["error"] = history.error
        return out
    node_mtbi = history.node_mtbi(prior_s)
    return {**base, "source": "accounting", "node_mtbi_s": node_mtbi, "mtbi_s": node_mtbi / nodes,
            "interruptions": history.interruptions, "node_s": history.node_s, "runs": history.runs,
            "measured_at": history.measured_at, "partition": history.partition}
