"""The agent's part in the job's epochs (service.py routes the phases here): SIZE, PREPARE, CAPTURE, RESUME,
ABORT and FINISH for its tree, each judged by the site policy and recorded should it fail. Its own state:
the last PREPARE let through, when the last periodic capture began, and the time Slurm gives a final one."""
from __future__ import annotations

import time
from typing import Any

from slurmckpt import validate
from slurmckpt.agent import window
from slurmckpt.agent.facts import TaskFacts
from slurmckpt.agent.job import message_epoch as _epoch
from slurmckpt.agent.plan import TaskPlan
from slurmckpt.agent.tree import TaskTree
from slurmckpt.errors import PermissionDenied, ProtocolError

PHASE_OPS = ("size", "prepare", "capture", "resume")


class EpochControl:
    def __init__(self, facts: TaskFacts, plan: TaskPlan, tree: TaskTree,
                 final_window: window.FinalWindow | None = None) -> None:
        """`final_window`: the time Slurm gives a final capture (agent/start.py)."""
        self.facts, self.plan, self.tree = facts, plan, tree
        self.final_window = final_window
        self.last_periodic: float | None = None    # monotonic time of the last periodic capture's PREPARE
        self.prepared: tuple[int, bool, float] | None = None   # the last PREPARE let through: epoch, final, when

    def failed_stage(self, message: dict[str, Any]) -> str:
        """The stage that failed, for the epoch's phases (the coordinator's abort message names it)."""
        return self.tree.runner.failed_stage if message.get("op") in PHASE_OPS else ""

    def _require_policy(self, epoch: int, final: bool) -> None:
        """A capture the site policy forbids is refused before anything is frozen."""
        since = None if self.last_periodic is None else time.monotonic() - self.last_periodic
        refused = self.facts.policy.capture_refusal(final, since)
        if refused:
            if self.facts.events:
                self.facts.events.refused(*refused)
            raise PermissionDenied(f"{refused[1]}; nothing was frozen", epoch=epoch)

    def _epoch_began(self, m: dict[str, Any]) -> None:
        """The first phase of an epoch (SIZE for GPU jobs, else PREPARE): recorded, and refused here, before
        anything is frozen, if the site policy forbids it."""
        final = validate.flag(m["final"], "final") if "final" in m else None
        self.facts.failures().epoch_began(_epoch(m), final, validate.label(m.get("trigger", "unknown"), "trigger"))
        self._require_policy(_epoch(m), bool(final))

    # ---- operations ------------------------------------------------------------------------------------
    def size(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self._epoch_began(m)
        with self.facts.failures().recorded(_epoch(m), "size", self.tree.runner):
            reply = window.sized(self.tree.runner, _epoch(m), m, self.final_window, self.facts.store, self.plan.step,
                                 self.facts.ident.rank, self.tree.limits)
        self.tree.follow_size()
        return reply

    def prepare(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self._epoch_began(m)
        # `final` is fixed here, where the policy judged it: CAPTURE takes this one, never its own (a
        # "final" PREPARE, exempt from min_interval, followed by a periodic CAPTURE was a periodic capture
        # as often as the job liked)
        self.prepared = (_epoch(m), m.get("final") is True, time.monotonic())
        if self.facts.events:
            self.facts.events.preparing(_epoch(m))
        with self.facts.failures().recorded(_epoch(m), "prepare", self.tree.runner):
            return self.tree.runner.prepare(_epoch(m))

    def capture(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        epoch, said = _epoch(m), validate.flag(m.get("final", True), "final")
        if self.prepared is None or self.prepared[0] != epoch:
            raise ProtocolError(f"CAPTURE of epoch {epoch} without its PREPARE", epoch=epoch)
        _, final, prepared_at = self.prepared
        if "final" in m and said != final:
            raise ProtocolError(f"CAPTURE says final={said}, its PREPARE said final={final}", epoch=epoch)
        if not final:       # counted from its PREPARE, resumed or not (an aborted capture was one too)
            self.last_periodic = prepared_at
        failures = self.facts.failures()
        failures.epoch_is_final(epoch, final)
        with failures.recorded(epoch, "capture", self.tree.runner):
            reply = self.tree.runner.capture(epoch, final=final)
        if self.facts.events:
            self.facts.events.captured(epoch, failures.epoch[2], final, int(reply.get("bytes", 0)))
        return reply

    def resume(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.facts.events:
            self.facts.events.resumed(_epoch(m))
        with self.facts.failures().recorded(_epoch(m), "resume", self.tree.runner):
            reply = self.tree.runner.resume(_epoch(m))
        if self.facts.events:
            self.facts.events.persisted(_epoch(m))
        return reply

    def abort(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.facts.events:
            self.facts.events.aborted(_epoch(m))
        self.tree.runner.abort(_epoch(m))
        return {}

    def finish(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self.tree.runner.finish(_epoch(m))
        return {}
