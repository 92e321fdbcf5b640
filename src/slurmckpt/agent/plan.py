"""The agent's answers about what the task should do when it starts (service.py serves them): the plan
(restore which committed epoch, or run fresh; the interval and policy to schedule by; the srun relay), the
step a relayed srun takes over, and the notice of a fresh start after a requeue."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from slurmckpt.config import Config
from slurmckpt.errors import SlurmckptError, StorageError
from slurmckpt.agent.facts import TaskFacts
from slurmckpt.store.instance import mismatch, moved_aside_notes
from slurmckpt.identity import TaskIdentity
from slurmckpt.node.launch import relay_dir
from slurmckpt.store import handover, summary
from slurmckpt.store.jobstore import rank_name
from slurmckpt import validate
from slurmckpt.agent.job import message_epoch as _epoch

log = logging.getLogger("slurmckpt.agent")


def relay_path(config: Config, ident: TaskIdentity) -> str | None:
    """The batch step: where its wrapper serves the srun relay, the same path after every requeue (a
    restored launcher's environment names it), in a directory only the job's user can enter
    (launch.relay_dir; docs/security.md, "The srun relay and the step token")."""
    try:
        where = relay_dir(config.run_dir, ident.uid, ident.gid)
    except (OSError, SlurmckptError) as e:
        log.warning("no srun relay directory (%s): an MPI launcher's srun runs unrelayed", e)
        return None
    return os.path.join(where, str(ident.job))


class TaskPlan:
    """What this task is and does at its start; its own state: the step name it takes (a relayed srun's
    takes the capturing step's), its step token, and the epoch it restored."""

    def __init__(self, facts: TaskFacts, cgroup_procs: Callable[[], Path], interval_s: int = 0,
                 srun_relay: str | None = None, store_outage: str | None = None) -> None:
        """`cgroup_procs`: where the tree's processes are listed (its cgroup moves as Slurm places it);
        `interval_s`: the interval this task uses (the shim's, after the policy); `srun_relay`: the batch
        step's relay (relay_path); `store_outage`: the store did not answer at the start (agent/start.py)."""
        self.facts, self.cgroup_procs = facts, cgroup_procs
        self.interval_s, self.srun_relay, self.store_outage = interval_s, srun_relay, store_outage
        self.step = facts.ident.step       # or the step a relayed srun takes over (_adopt_step)
        self.step_token = ""
        self.token_unmatched = False       # a relayed srun's step token that no committed epoch holds
        self.restored: int | None = None   # the epoch this task restored (None: not restored)

    def restored_from(self, epoch: int) -> None:
        self.restored = epoch

    def plan(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """What this task should do: the committed epochs that hold it, newest first. A step whose srun the
        batch wrapper ran for a restored MPI launcher (`token`, srun_relay.py) takes the name of the step
        that captured the daemons, whatever step id Slurm gave it now: reply `step`."""
        settled = None
        try:
            why_not = self.not_restorable()
            if why_not is None:       # a final capture still on its way to the store is waited for first
                settled = handover.settle(self.facts.store, self.facts.config.persist_timeout_s)
            epochs = [] if why_not is not None else self.facts.store.committed()
            self._adopt_step(m.get("token"), epochs)
        except StorageError as e:
            why_not, epochs = str(e), []
        if why_not is not None:
            return {"candidates": [], "next_epoch": self.facts.store.next_epoch(), "completed": {},
                    **({"warning": why_not} if why_not else {}), **self._policy_plan(),
                    "tree_procs": str(self.cgroup_procs()), **self._relay_plan()}
        me = rank_name(self.step, self.facts.ident.rank)
        if self.token_unmatched:    # a relayed srun whose daemons no checkpoint holds: started afresh
            epochs = []
        # each with what restoring it costs the job (its age at the requeue, a lost final capture and why)
        candidates = [{"epoch": e["epoch"], **e["ranks"][me], "cost": handover.requeue_cost(self.facts.store, e)}
                      for e in epochs if me in e["ranks"]]
        completed = {n: r for n, r in (epochs[0]["ranks"].items() if epochs else []) if r["kind"] == "completed"}
        notes = moved_aside_notes(self.facts.store)[-1:]      # a foreign store moved aside at a commit (instance.py)
        if self.store_outage:                            # waited for the store's file system (agent/start.py)
            notes.append(self.store_outage)
        if candidates and self.facts.ident.step == "batch":   # a newer periodic capture failed: its work is lost
            notes += filter(None, [self.facts.failures().failed_since(candidates[0]["epoch"])])
        if settled is not None and settled.describe():
            notes.append(settled.describe())
        return {"candidates": candidates, "next_epoch": self.facts.store.next_epoch(), "completed": completed,
                "newest": epochs[0]["epoch"] if epochs else None, "tree_procs": str(self.cgroup_procs()),
                "step": self.step, **self._relay_plan(),
                **({"warning": "; ".join(notes)} if notes else {}), **self._policy_plan()}

    def _relay_plan(self) -> dict[str, Any]:
        return {"srun_relay": self.srun_relay} if self.srun_relay else {}

    def _adopt_step(self, token: object, epochs: list[dict[str, Any]]) -> None:
        """The step of the newest committed epoch whose record at this rank carries `token` becomes this
        task's name in the store and the job's cut. The token is the user's (the task's environment): it can
        only pick among this job's own steps, and never the batch step."""
        if not isinstance(token, str) or not validate.TOKEN_HEX16.fullmatch(token) or self.facts.ident.step == "batch":
            return
        self.step_token = token
        self.token_unmatched = bool(epochs)     # its step id names nothing: no restore by it (plan)
        for e in epochs:
            for name in e["ranks"]:
                step, rank = validate.rank_name(name)
                if step == "batch" or rank != self.facts.ident.rank:
                    continue
                try:
                    found = self.facts.store.read_rank_manifest(e["epoch"], step, rank).capture.tree.step_token == token
                except StorageError:
                    continue
                if found:
                    if step != self.step:
                        log.info("step %s takes the name %s: its srun was run again for a restored launcher",
                                 self.facts.ident.step, step)
                    self.step = step
                    self.facts.failures().rank = rank_name(step, rank)
                    self.token_unmatched = False
                    return

    def _policy_plan(self) -> dict[str, Any]:
        """The interval the wrapper schedules (the policy's default and minimum applied), and `disabled` when
        the policy forbids checkpoints for the job's partition or QOS: the wrapper then runs the task plainly.
        The wrapper handles the capture signals once it asks for its plan: the run record says so now."""
        plan: dict[str, Any] = {"interval_s": self.interval_s, "policy": self.facts.policy.describe(),
                                "auto": self._auto_plan()}
        refused = self.facts.policy.capture_refusal(final=True, since_last_s=None)
        if self.facts.events:
            if refused:
                self.facts.events.refused(*refused)
            self.facts.events.started(self.facts.ident.restart_count, self.interval_s, plan["policy"],
                                refused[1] if refused else None)
        return {**plan, "disabled": refused[1]} if refused else plan

    def _auto_plan(self) -> dict[str, Any]:
        """What a coordinator this task hosts needs for --checkpoint-interval=auto (coordinator/interval.py):
        the policy's bounds, the first interval, the site's M for the job's nodes until accounting answers
        (JobOperations.interruptions), and the stalls an earlier run of the job measured."""
        policy, config = self.facts.policy, self.facts.config
        low, high = policy.auto_bounds()
        return {"min_s": low, "max_s": high, "first_s": config.auto_first_interval,
                "mtbi_s": config.interruption_mtbi / self.facts.job_nodes(), "min_from": policy.min_from,
                "max_from": policy.max_from, "stalls": summary.recorded_stalls(self.facts.store)}

    def not_restorable(self) -> str | None:
        """None when this task may restore the store's images; else why not ("" for a first run with
        nothing to say). Images are bound to the job instance that wrote them (instance.py)."""
        if self.facts.instance is None:
            return (f"checkpoints of job {self.facts.ident.job} are not restored: slurmckpt could not learn the "
                    "job's instance (uid, gid, submit time) from Slurm")
        if self.facts.ident.restart_count == 0:       # a job that was never requeued has nothing to restore
            note = self.facts.store_note
            return "; ".join([note] if note else moved_aside_notes(self.facts.store)[-1:])
        why = mismatch(self.facts.store.read_manifest().get("instance"), self.facts.instance)
        if why:
            return f"checkpoints of job {self.facts.ident.job} are not restored: {why}"
        return None

    def standins(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """How many srun stand-in sockets the restore of `epoch` needs handed in."""
        manifest = self.facts.store.read_rank_manifest(_epoch(m), self.step, self.facts.ident.rank)
        return {"count": len(manifest.capture.sockets.srun_standins)}

    def fresh_start(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The batch step of a requeued job that restored nothing: the line its wrapper prints first, also
        set as the job's AdminComment (fresh_start.py). None for a first run or a restored one."""
        if self.facts.ident.step != "batch" or not self.facts.ident.restart_count or self.restored is not None:
            return {"notice": None}
        return {"notice": self.fresh_start_notice()}

    def fresh_start_notice(self) -> str:
        try:
            why_not = self.not_restorable()
        except StorageError as e:
            why_not = str(e)
        notice = self.facts.failures().fresh_start(self.facts.ident.restart_count, why_not or self.facts.store_note)
        if self.facts.events:
            self.facts.events.fresh_start(notice)
        return notice
