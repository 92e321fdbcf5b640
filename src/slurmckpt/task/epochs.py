"""The wrapper's side of the job's epochs (task/wrapper.py composes it): the coordinator's commands for this
rank, what an epoch's end means for the task (a committed final capture, an abort told to the user, the
requeue), and, for a wrapper hosting the coordinator, the interval it chose."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from slurmckpt.config import Config
from slurmckpt.duration import AUTO
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.env import TaskEnv
from slurmckpt.task.schedule import Schedule

log = logging.getLogger("slurmckpt.wrapper")


class EpochHandling:
    """The coordinator's commands for this rank and the ends of its epochs; its own state: whether a final
    capture is under way or committed, the current epoch's capture timeout, the notes already said, the
    schedule of a wrapper that supervises the job, and the automatic interval not yet recorded."""

    def __init__(self, config: Config, call: Callable[..., dict[str, Any]], say: Callable[[str], None],
                 job_id: int, pass_sigterm_on: Callable[[], None], final_failed: Callable[[], None]) -> None:
        """`call`: the agent's operations; `pass_sigterm_on`: Slurm's SIGTERM to the tree, when the final
        capture this wrapper's coordinator ran failed; `final_failed`: the coordinator's word that the job's
        final capture at Slurm's SIGTERM failed (task/wrapper.py)."""
        self.config, self.call, self._say, self.job_id = config, call, say, job_id
        self.pass_sigterm_on, self.final_failed = pass_sigterm_on, final_failed
        self.final_committed = threading.Event()
        self.final_capture = threading.Event()          # criu ends the tree itself in a final capture
        self.capture_timeout_s = config.capture_timeout_s    # the coordinator's, for the current epoch
        self.noted: set[str] = set()             # size notes already said (once per run, not per epoch)
        self.schedule: Schedule | None = None    # a supervising wrapper's interval and wall-time triggers
        # --checkpoint-interval=auto: the newest choice of the hosted coordinator not yet recorded
        self.choice_lock = threading.Lock()
        self.choice_pending: dict[str, Any] | None = None
        self.choice_recorder = False

    def schedule_job(self, env: TaskEnv) -> None:
        """This wrapper supervises the job's epochs (membership.py): it triggers them on time."""
        self.schedule = Schedule.for_job(env, self.config)

    def interval_chosen(self, choice: dict[str, Any], line: str, changed: bool) -> None:
        """The coordinator this task hosts chose an automatic interval (coordinator/interval.py): said in the
        job's stderr when it changed, recorded by the agent for `slurmckpt status` (and a requeued run) always,
        off the coordinator's link, newest last: one recorder thread takes the latest choice each time."""
        if changed:
            self._say(line)
        with self.choice_lock:
            self.choice_pending, running = choice, self.choice_recorder
            self.choice_recorder = True
        if not running:
            threading.Thread(target=self._record_choices, name="interval-record", daemon=True).start()

    def _record_choices(self) -> None:
        while True:
            with self.choice_lock:
                choice, self.choice_pending = self.choice_pending, None
                if choice is None:
                    self.choice_recorder = False
                    return
            try:
                self.call("interval_chosen", choice=choice)
            except SlurmckptError as e:
                log.warning("the interval chosen was not recorded: %s", e)

    def epoch_result(self, result: dict[str, Any], reason: str, final: bool) -> None:
        if result["status"] == "committed" and result.get("persisting"):
            # inside Slurm's window only the dump into staging: the store and the commit come after the job
            self._say(f"checkpoint epoch {result['epoch']} captured ({reason}): {result['ranks']} rank(s), "
                      f"{result['bytes'] / 2**20:.1f} MiB in staging, frozen->handed over {result['commit_s']:.2f}s, "
                      f"consistent cut after {result.get('cut_s', 0):.3f}s; persisted to the image store and "
                      "committed after the job ends (its restore waits for that)")
            if final and reason in ("walltime", "manual-requeue"):
                threading.Thread(target=self.requeue, daemon=True).start()
        elif result["status"] == "committed":
            self._say(f"checkpoint epoch {result['epoch']} committed ({reason}): {result['ranks']} rank(s), "
                          f"{result['bytes'] / 2**20:.1f} MiB, frozen->committed {result['commit_s']:.2f}s, "
                          f"consistent cut after {result.get('cut_s', 0):.3f}s in {result.get('lock_rounds', 1)} "
                          "round(s)")
            if self.schedule:
                self.schedule.captured(result["commit_s"])
            if final and reason in ("walltime", "manual-requeue"):
                threading.Thread(target=self.requeue, daemon=True).start()
        elif result["status"] == "aborted" and result.get("error_kind") == "ended" and not final:
            log.info("%s: a rank's task had just ended", abort_message(result, reason))   # the next one goes on
        elif result["status"] == "aborted":
            self._say(abort_message(result, reason))
            threading.Thread(target=self._report_failure, args=(result, reason, final), daemon=True).start()
            if final and reason == "sigterm":
                # Nothing was captured: the program gets the SIGTERM Slurm sent, as it would without slurmckpt
                # (its own handler may save its state) instead of running on until KillWait's SIGKILL.
                self._say(f"the final capture {'was not taken' if result.get('stage') == 'window' else 'failed'}: "
                          "passing Slurm's SIGTERM on to the program")
                threading.Thread(target=self.pass_sigterm_on, daemon=True).start()

    def _report_failure(self, result: dict[str, Any], reason: str, final: bool) -> None:
        """The coordinator's verdict goes to the root agent, which records it in the job's store unless the
        failing rank's agent did (fresh_start.py): timeouts and vanished ranks are seen only here."""
        try:
            self.call("capture_failed", epoch=result["epoch"], final=final, trigger=reason,
                      stage=str(result.get("stage") or "unknown"), rank=result.get("rank"),
                      node=result.get("node"), error=str(result.get("error", ""))[:4096])
        except SlurmckptError as e:
            log.warning("the failed epoch %s was not recorded: %s", result.get("epoch"), e)

    def requeue(self) -> None:
        from slurmckpt.slurm.control import default_control
        try:
            default_control().requeue(self.job_id)
            self._say("job requeued; it resumes from this checkpoint when it starts again")
        except SlurmckptError as e:
            self._say(f"requeue failed: {e}")

    def on_command(self, kind: str, epoch: int, message: dict[str, Any]) -> dict[str, Any]:
        if kind == "pass-sigterm":        # nothing for the agent: the wrapper's own signal handling
            self.final_failed()
            return {}
        if kind == "finish":
            self.final_committed.set()
        elif kind == "capture" and message.get("final", True):
            self.final_capture.set()
        elif kind == "abort":
            self.final_capture.clear()
        if kind == "capture" and isinstance(message.get("timeout_s"), (int, float)):
            self.capture_timeout_s = max(self.config.capture_timeout_s, float(message["timeout_s"]))
        args: dict[str, Any] = {"final": bool(message.get("final", True))} if kind == "capture" else {}
        if kind in ("size", "prepare"):       # what the agent records should its part fail (fresh_start.py), and
            args = {k: message[k] for k in ("final", "trigger", "trigger_age_s") if k in message}   # its window
        reply = {k: v for k, v in self.call(kind, epoch=epoch, **args).items() if k != "ok"}
        for note in reply.pop("notes", []):   # for the user, not the coordinator; once per run
            if note not in self.noted:
                self.noted.add(note)
                self._say(f"note: {note}")
        return reply

    def await_final_commit(self) -> None:
        """The tree ended because a final capture dumped it: its epoch decides (commit or abort)."""
        deadline = time.monotonic() + self.capture_timeout_s + 60
        while self.final_capture.is_set() and not self.final_committed.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)


def with_interval(plan: dict[str, Any], env: TaskEnv, say: Callable[[str], None]) -> TaskEnv:
    """The agent's interval: the site policy's default where the job gave none, never below its minimum."""
    interval = plan.get("interval_s")
    if isinstance(interval, int) and interval != env.interval_s:
        rule = plan.get("policy") or {}
        source = rule.get("min_interval_from") if interval == rule.get("min_interval_s") else \
            rule.get("default_interval_from")
        shown = "auto" if interval == AUTO else f"{interval}s"
        say(f"checkpoint interval {shown}, set by the site policy ({source or 'slurmckpt.yaml'})")
        return dataclasses.replace(env, interval_s=interval)
    return env


def abort_message(result: dict[str, Any], reason: str) -> str:
    """The job's line for an aborted epoch: rank, node, stage and reason, and whether undoing it completed."""
    where = ", ".join(f"{what} {result[what]}" for what in ("rank", "node", "stage") if result.get(what))
    if result.get("stage") == "window":       # refused before anything was frozen (agent/window.py)
        return (f"checkpoint epoch {result['epoch']} ({reason}) NOT TAKEN ({where}): {result.get('error')}; the "
                "previous checkpoint stays the one restored")
    text = (f"checkpoint epoch {result['epoch']} ({reason}) ABORTED ({where or 'no rank took part'}): "
            f"{result.get('error') or 'no reason given'}")
    if result.get("abort"):
        text += f"; undoing it did not complete: {result['abort']}"
    return text + "; the previous checkpoint stays the one restored"
