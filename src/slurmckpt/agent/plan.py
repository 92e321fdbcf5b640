"""The agent's answers about what the task should do when it starts (service.py serves them): the plan
(restore which committed epoch, or run fresh; the interval and policy to schedule by; the srun relay), the
step a relayed srun takes over, and the notice of a fresh start after a requeue."""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

from slurmckpt.config import Config
from slurmckpt.errors import SlurmckptError, StorageError
from slurmckpt.agent.events import AgentEvents
from slurmckpt.store.fresh_start import FailureReporter
from slurmckpt.store.instance import JobInstance, mismatch, moved_aside_notes
from slurmckpt.identity import TaskIdentity
from slurmckpt.node import procfs
from slurmckpt.node.launch import relay_dir
from slurmckpt.policy import JobPolicy
from slurmckpt.store import handover, summary
from slurmckpt.slurm.control import this_node
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.store.jobstore import JobStore, rank_name
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt import validate
from slurmckpt.agent.job import JobOps, message_epoch as _epoch

log = logging.getLogger("slurmckpt.agent")


class TaskPlan(JobOps):
    # what the agent (service.py) sets up and these operations share
    ident: TaskIdentity
    config: Config
    store: JobStore
    cgroup: TaskCgroup
    step: str
    step_token: str
    instance: JobInstance | None
    slurm_job: JobRecord | None
    store_note: str | None
    reporter: FailureReporter | None
    events: AgentEvents | None
    policy: JobPolicy
    interval_s: int
    restored: int | None
    store_outage: str | None
    token_unmatched: bool
    srun_relay: str | None
    wrapper_pid: int

    def op_plan(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """What this task should do: the committed epochs that hold it, newest first. A step whose srun the
        batch wrapper ran for a restored MPI launcher (`token`, srun_relay.py) takes the name of the step
        that captured the daemons, whatever step id Slurm gave it now: reply `step`."""
        settled = None
        try:
            why_not = self._not_restorable()
            if why_not is None:       # a final capture still on its way to the store is waited for first
                settled = handover.settle(self.store, self.config.persist_timeout_s)
            epochs = [] if why_not is not None else self.store.committed()
            self._adopt_step(m.get("token"), epochs)
        except StorageError as e:
            why_not, epochs = str(e), []
        if why_not is not None:
            return {"candidates": [], "next_epoch": self.store.next_epoch(), "completed": {},
                    **({"warning": why_not} if why_not else {}), **self._policy_plan(),
                    "tree_procs": str(self.cgroup.path / "cgroup.procs"), **self._relay_plan()}
        me = rank_name(self.step, self.ident.rank)
        if self.token_unmatched:    # a relayed srun whose daemons no checkpoint holds: started afresh
            epochs = []
        # each with what restoring it costs the job (its age at the requeue, a lost final capture and why)
        candidates = [{"epoch": e["epoch"], **e["ranks"][me], "cost": handover.requeue_cost(self.store, e)}
                      for e in epochs if me in e["ranks"]]
        completed = {n: r for n, r in (epochs[0]["ranks"].items() if epochs else []) if r["kind"] == "completed"}
        notes = moved_aside_notes(self.store)[-1:]      # a foreign store moved aside at a commit (instance.py)
        if self.store_outage:                            # waited for the store's file system (agent/start.py)
            notes.append(self.store_outage)
        if candidates and self.ident.step == "batch":   # a newer periodic capture failed: its work is lost
            notes += filter(None, [self._failures().failed_since(candidates[0]["epoch"])])
        if settled is not None and settled.describe():
            notes.append(settled.describe())
        return {"candidates": candidates, "next_epoch": self.store.next_epoch(), "completed": completed,
                "newest": epochs[0]["epoch"] if epochs else None, "tree_procs": str(self.cgroup.path / "cgroup.procs"),
                "step": self.step, **self._relay_plan(),
                **({"warning": "; ".join(notes)} if notes else {}), **self._policy_plan()}

    def _relay_plan(self) -> dict[str, Any]:
        return {"srun_relay": self.srun_relay} if self.srun_relay else {}

    def _relay_path(self) -> str | None:
        """The batch step: where its wrapper serves the srun relay, the same path after every requeue (a
        restored launcher's environment names it), in a directory only the job's user can enter
        (launch.relay_dir; docs/security.md, "The srun relay and the step token")."""
        try:
            where = relay_dir(self.config.run_dir, self.ident.uid, self.ident.gid)
        except (OSError, SlurmckptError) as e:
            log.warning("no srun relay directory (%s): an MPI launcher's srun runs unrelayed", e)
            return None
        return os.path.join(where, str(self.ident.job))

    def _adopt_step(self, token: object, epochs: list[dict[str, Any]]) -> None:
        """The step of the newest committed epoch whose record at this rank carries `token` becomes this
        task's name in the store and the job's cut. The token is the user's (the task's environment): it can
        only pick among this job's own steps, and never the batch step."""
        if not isinstance(token, str) or not validate.TOKEN_HEX16.fullmatch(token) or self.ident.step == "batch":
            return
        self.step_token = token
        self.token_unmatched = bool(epochs)     # its step id names nothing: no restore by it (op_plan)
        for e in epochs:
            for name in e["ranks"]:
                step, rank = validate.rank_name(name)
                if step == "batch" or rank != self.ident.rank:
                    continue
                try:
                    found = self.store.read_rank_manifest(e["epoch"], step, rank).capture.tree.step_token == token
                except StorageError:
                    continue
                if found:
                    if step != self.step:
                        log.info("step %s takes the name %s: its srun was run again for a restored launcher",
                                 self.ident.step, step)
                    self.step = step
                    self._failures().rank = rank_name(step, rank)
                    self.token_unmatched = False
                    return

    def _policy_plan(self) -> dict[str, Any]:
        """The interval the wrapper schedules (the policy's default and minimum applied), and `disabled` when
        the policy forbids checkpoints for the job's partition or QOS: the wrapper then runs the task plainly.
        The wrapper handles the capture signals once it asks for its plan: the run record says so now."""
        plan: dict[str, Any] = {"interval_s": self.interval_s, "policy": self.policy.describe(),
                                "auto": self._auto_plan()}
        refused = self.policy.capture_refusal(final=True, since_last_s=None)
        if self.events:
            if refused:
                self.events.refused(*refused)
            self.events.started(self.ident.restart_count, self.interval_s, plan["policy"],
                                refused[1] if refused else None)
        return {**plan, "disabled": refused[1]} if refused else plan

    def _auto_plan(self) -> dict[str, Any]:
        """What a coordinator this task hosts needs for --checkpoint-interval=auto (coordinator/interval.py):
        the policy's bounds, the first interval, the site's M for the job's nodes until accounting answers
        (op_interruptions), and the stalls an earlier run of the job measured."""
        low, high = self.policy.auto_bounds()
        return {"min_s": low, "max_s": high, "first_s": self.config.auto_first_interval,
                "mtbi_s": self.config.interruption_mtbi / self._job_nodes(), "min_from": self.policy.min_from,
                "max_from": self.policy.max_from, "stalls": summary.recorded_stalls(self.store)}


    def _not_restorable(self) -> str | None:
        """None when this task may restore the store's images; else why not ("" for a first run with
        nothing to say). Images are bound to the job instance that wrote them (instance.py)."""
        if self.instance is None:
            return (f"checkpoints of job {self.ident.job} are not restored: slurmckpt could not learn the "
                    "job's instance (uid, gid, submit time) from Slurm")
        if self.ident.restart_count == 0:       # a job that was never requeued has nothing to restore
            return "; ".join([self.store_note] if self.store_note else moved_aside_notes(self.store)[-1:])
        why = mismatch(self.store.read_manifest().get("instance"), self.instance)
        if why:
            return f"checkpoints of job {self.ident.job} are not restored: {why}"
        return None

    def op_standins(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """How many srun stand-in sockets the restore of `epoch` needs handed in."""
        manifest = self.store.read_rank_manifest(_epoch(m), self.step, self.ident.rank)
        return {"count": len(manifest.capture.sockets.srun_standins)}

    def op_fresh_start(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The batch step of a requeued job that restored nothing: the line its wrapper prints first, also
        set as the job's AdminComment (fresh_start.py). None for a first run or a restored one."""
        if self.ident.step != "batch" or not self.ident.restart_count or self.restored is not None:
            return {"notice": None}
        return {"notice": self._fresh_start_notice()}

    def _fresh_start_notice(self) -> str:
        try:
            why_not = self._not_restorable()
        except StorageError as e:
            why_not = str(e)
        notice = self._failures().fresh_start(self.ident.restart_count, why_not or self.store_note)
        if self.events:
            self.events.fresh_start(notice)
        return notice

    def _allocated_gpus(self) -> tuple[str, str]:
        """The GPUs this task restores onto: Slurm's allocation of the job on this node (indices in gres.conf
        File= order, i.e. /dev/nvidiaN order = PCI bus order), never the wrapper's environment. A step that
        narrows them with CUDA_VISIBLE_DEVICES to allocated indices keeps its narrowing; any other value is
        ignored (a user naming a GPU of another job changes nothing)."""
        node, allocated = self._slurm_gpus_here()
        claimed = procfs.environ(self.wrapper_pid).get("CUDA_VISIBLE_DEVICES", "")
        items = [s.strip() for s in claimed.split(",") if s.strip()]
        narrowed = bool(items) and all(s.isdigit() and int(s) in allocated for s in items) \
            and len(set(items)) == len(items)
        chosen = [int(s) for s in items] if narrowed else allocated
        log.info("GPUs for restore from Slurm's allocation on %s: %s; used: %s (wrapper's CUDA_VISIBLE_DEVICES "
                 "%r %s)", node, allocated, chosen, claimed[:64], "narrows it" if narrowed else "not used")
        return ",".join(str(i) for i in chosen), "PCI_BUS_ID"

    def _slurm_gpus_here(self) -> tuple[str, list[int]]:
        """(this node's name, the GPU indices Slurm allocated to the job on it); none when Slurm could not
        be asked."""
        gpus = self.slurm_job.gpus if self.slurm_job else {}
        node = this_node(sorted(gpus), socket.gethostname()) or socket.gethostname()
        return node, gpus.get(node, [])

