"""What one agent tells the outside world about its task's captures and restores (docs/operations.md):

- slurmd's log: one line per committed epoch (by the agent that commits it), per restore and restore
  failure, per failed capture and per policy refusal, `slurmckpt: job=N rank=S.R event=... key=value...`.
  The agent writes it to the log relay the SPANK plugin holds open in slurmstepd (`--log-fd`; slurmstepd's
  own stderr is /dev/null), which logs it with slurm_info()/slurm_error() under the step's `[N.S]` prefix;
- the node's Prometheus metrics (metrics.py);
- the job's comment field (store/job_comment.py) and the user-readable summary (summary.py).

The job's stderr gets its lines from the wrapper (wrapper.py `say`). Nothing here may fail a capture or a
restore: every outlet logs its own failure and goes on.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from slurmckpt.store import summary
from slurmckpt.config import Config
from slurmckpt.agent.metrics import NodeMetrics
from slurmckpt.slurm.comment import one_line
from slurmckpt.store.job_comment import JobComment
from slurmckpt.store.jobstore import JobStore
from slurmckpt.identity import RankName
from slurmckpt.store.fresh_start import CaptureFailure

log = logging.getLogger("slurmckpt.events")

MAX_LINE = 900          # bytes of one relayed line: below PIPE_BUF, so lines from several agents never mix


class SlurmdLog:
    """The write end of the plugin's log relay (None: no relay, e.g. an agent started by hand)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)          # criu, setpriv, the tree: none of them may write here
            os.set_blocking(fd, False)             # a stuck relay costs lines, never a capture

    def line(self, level: str, fields: dict[str, object]) -> None:
        text = " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
        log.info("slurmd log: %s", text)
        if self.fd is None:
            return
        data = (f"{level} " + text).encode()[:MAX_LINE] + b"\n"
        try:
            os.write(self.fd, data)
        except BlockingIOError:
            log.warning("log relay full: line dropped")
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.EBADF):
                self.fd = None
            log.warning("log relay gone (%s): no more lines to slurmd's log", e)


def _value(v: object) -> str:
    text = one_line(v, 400)
    return text if text and all(c not in text for c in ' "=') else '"' + text.replace('"', "'") + '"'


@dataclass(frozen=True)
class Task:
    job: int
    step: str
    rank: int
    uid: int
    node: str

    @property
    def name(self) -> str:
        return str(RankName(self.step, self.rank))


class AgentEvents:
    def __init__(self, task: Task, store: JobStore, config: Config, relay: SlurmdLog, comment: JobComment,
                 metrics: NodeMetrics) -> None:
        self.task, self.store, self.config = task, store, config
        self.relay, self.comment, self.metrics = relay, comment, metrics
        self.stopped_at: dict[int, float] = {}      # epoch -> monotonic time of its PREPARE
        self._publishing = threading.Lock()          # the agent's thread and a deferred publish (publish_soon)
        self._soon: threading.Timer | None = None

    def _line(self, level: str, event: str, **fields: object) -> None:
        self.relay.line(level, {"job": self.task.job, "rank": self.task.name, "node": self.task.node,
                                "event": event, **fields})

    def publish_summary(self) -> None:
        try:
            with self._publishing:
                summary.publish(self.store, self.config.summary_dir, self.task.uid)
        except Exception as e:  # noqa: BLE001 - the summary informs only
            log.warning("job summary not published: %s", e)

    def publish_soon(self, delay_s: float = 1.0) -> None:
        """Publish `delay_s` from now, once for every call until then: what the job's wrapper may ask for as
        often as it likes (the automatic interval's record) reaches the shared file system at most once
        a second."""
        if self._soon is None or not self._soon.is_alive():
            self._soon = threading.Timer(delay_s, self.publish_summary)
            self._soon.daemon = True
            self._soon.start()

    # ---- the task's life ------------------------------------------------------------------------------
    def started(self, restart_count: int, interval_s: int, policy: dict[str, Any] | None, disabled: str | None) -> None:
        """The task's wrapper asked for its plan (it handles capture signals from now on)."""
        self.metrics.gauge("slurmckpt_agents", 1)
        self._run(restart_count=restart_count, started_at=time.time(), batch_node=self.task.node,
                  interval_s=interval_s, policy=policy, disabled=disabled, restored_epoch=None, fresh_start=None)

    def _run(self, **fields: object) -> None:
        """The batch step's record of this run (summary.py), published for the job's user."""
        if self.task.step != "batch" or self.task.rank != 0:
            return
        try:
            summary.update_run(self.store, fields)
        except OSError as e:
            log.warning("run record not written: %s", e)
        self.publish_summary()

    def gpu_transports(self, line: str) -> None:
        """A step's NCCL trade on a node with several of the job's GPUs (cuda/nccl.py), for `slurmckpt status`:
        recorded by the step's rank 0."""
        if self.task.rank != 0:
            return
        try:
            summary.record_gpu_transports(self.store, self.task.step, line)
        except OSError as e:
            log.warning("GPU transports not recorded: %s", e)
        self.publish_summary()

    def fresh_start(self, notice: str) -> None:
        self._run(fresh_start=notice)

    def stopped(self) -> None:
        self.metrics.gauge("slurmckpt_persists_pending", None)
        self.metrics.gauge("slurmckpt_agents", None)
        self.comment.flush()

    # ---- captures -------------------------------------------------------------------------------------
    def preparing(self, epoch: int) -> None:
        self.stopped_at[epoch] = time.monotonic()

    def captured(self, epoch: int, trigger: str, final: bool, nbytes: int) -> None:
        self.metrics.count("slurmckpt_captures_total", trigger)
        self.metrics.count("slurmckpt_captured_bytes_total", by=nbytes)
        self.metrics.gauge("slurmckpt_persists_pending", 0 if final else 1)

    def resumed(self, epoch: int) -> None:
        """Called when RESUME arrives (the thaw follows at once): the stall ends here."""
        started = self.stopped_at.pop(epoch, None)
        if started is not None:
            self.metrics.observe("slurmckpt_stall_seconds", time.monotonic() - started)

    def persisted(self, epoch: int) -> None:
        self.metrics.gauge("slurmckpt_persists_pending", 0)

    def committed(self, epoch: int, trigger: str, ranks: dict[str, dict[str, Any]], final: bool) -> None:
        nbytes = summary.epoch_bytes(self.store, {"epoch": epoch, "ranks": ranks})
        nodes = sorted({r["node"] for r in ranks.values() if r.get("node")})
        self._line("info", "commit", epoch=epoch, trigger=trigger, final=str(final).lower(), ranks=len(ranks),
                   nodes=",".join(nodes), bytes=nbytes)
        self.metrics.count("slurmckpt_commits_total", trigger)
        self.comment.checkpoint(epoch, time.time(), nbytes, final=final)
        self.publish_summary()

    def handed_over(self, epoch: int, trigger: str, ranks: dict[str, dict[str, Any]], committed: bool) -> None:
        """A final epoch every rank dumped into staging: its persisters take it to the store after the job
        (store/handover.py); committed already when they were done before this."""
        self._line("info", "handover", epoch=epoch, trigger=trigger, ranks=len(ranks), committed=str(committed).lower())
        if committed:
            self.committed(epoch, trigger, ranks, final=True)

    def capture_failed(self, failure: CaptureFailure) -> None:
        """fresh_start.CaptureFailure, once per epoch (the first agent that saw it records it)."""
        self.stopped_at.pop(failure.epoch, None)
        self._line("error", "capture-failed", epoch=failure.epoch, final=str(failure.final).lower(),
                   trigger=failure.trigger, stage=failure.stage, failed_rank=failure.rank or None,
                   seen_by=failure.seen_by, reason=failure.reason)
        self.metrics.count("slurmckpt_capture_failures_total", failure.stage)
        self.metrics.gauge("slurmckpt_persists_pending", 0)
        self.publish_summary()

    def aborted(self, epoch: int) -> None:
        self.stopped_at.pop(epoch, None)
        self.metrics.gauge("slurmckpt_persists_pending", 0)

    # ---- restores, notes, policy ----------------------------------------------------------------------
    def restored(self, epoch: int, seconds: float) -> None:
        self._line("info", "restore", epoch=epoch, seconds=f"{seconds:.2f}")
        self.metrics.count("slurmckpt_restores_total", "ok")
        self.metrics.observe("slurmckpt_restore_seconds", seconds)
        self._run(restored_epoch=epoch)

    def restore_failed(self, epoch: int, reason: str) -> None:
        self._line("error", "restore-failed", epoch=epoch, reason=reason)
        self.metrics.count("slurmckpt_restores_total", "failed")

    def withdrawn(self, epoch: int, reason: str) -> None:
        self._line("error", "epoch-withdrawn", epoch=epoch, reason=reason)
        self.publish_summary()

    def note(self, job: int, text: str) -> str:
        """fresh_start.FailureReporter's annotate: the job's comment, the summary and slurmd's log."""
        field = self.comment.note(job, text)
        self._line("info", "note", text=text.removeprefix("slurmckpt:").strip())
        self.publish_summary()
        return field

    def refused(self, rule: str, what: str) -> None:
        self._line("error", "policy-refused", rule=rule, reason=what)
        self.metrics.count("slurmckpt_policy_refusals_total", rule)
