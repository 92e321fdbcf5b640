"""The per-task privileged agent (root). Started by the SPANK shim in slurm_spank_task_init_privileged as a
child of the task, so job, step, rank and uid come from Slurm, not from the user.

It serves exactly one peer, the task's wrapper, over an inherited socket, and acts only on the tree it
started or restored itself and on this job's images: no request names a pid, a path or another job.
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable

from slurmckpt.agent.epochs import EpochControl
from slurmckpt.agent.events import AgentEvents
from slurmckpt.agent.facts import TaskFacts
from slurmckpt.agent.job import JobOperations
from slurmckpt.agent.plan import TaskPlan, relay_path
from slurmckpt.agent.tree import TaskTree
from slurmckpt.agent.window import FinalWindow
from slurmckpt.channel import Channel
from slurmckpt.config import Config
from slurmckpt.errors import ProtocolError, SlurmckptError, StorageError
from slurmckpt.identity import TaskIdentity
from slurmckpt.node.peer import Peer
from slurmckpt.policy import JobPolicy
from slurmckpt.rank.images import StorePolicy
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.store.fresh_start import FailureReporter
from slurmckpt.store.instance import JobInstance, claim
from slurmckpt.store.jobstore import JobStore, rank_name

log = logging.getLogger("slurmckpt.agent")

Operation = Callable[[dict[str, Any], list[int]], dict[str, Any]]


class Agent:
    """Serves the wrapper's requests, each routed through one table (`operations`) to the part that owns
    what it acts on: the task's plan (plan.py), its tree (tree.py), the epochs' phases (epochs.py) and the
    job-wide operations (job.py). A name that is not in the table is refused."""

    def __init__(self, facts: TaskFacts, channel: Channel, peer: Peer, plan: TaskPlan, tree: TaskTree,
                 epochs: EpochControl, job: JobOperations) -> None:
        self.facts, self.channel, self.peer = facts, channel, peer
        self.plan, self.tree, self.epochs, self.job = plan, tree, epochs, job
        # The operation names the wrapper may ask for, and nothing else: the name comes from the job's user.
        self.operations: dict[str, Operation] = {
            "hello": self.hello,
            "plan": plan.plan, "standins": plan.standins, "fresh_start": plan.fresh_start,
            "launch": tree.launch, "restore": tree.restore, "pmi_socket": tree.pmi_socket,
            "srun_standin": tree.srun_standin, "tree_fate": tree.tree_fate,
            "size": epochs.size, "prepare": epochs.prepare, "capture": epochs.capture, "resume": epochs.resume,
            "abort": epochs.abort, "finish": epochs.finish,
            "interruptions": job.interruptions, "interval_chosen": job.interval_chosen,
            "capture_failed": job.capture_failed, "commit": job.commit, "allocate_epoch": job.allocate_epoch,
            "reject_epoch": job.reject_epoch, "publish_coordinator": job.publish_coordinator,
            "lookup_coordinator": job.lookup_coordinator,
        }

    @classmethod
    def start(cls, ident: TaskIdentity, channel: Channel, config: Config, peer: Peer,
              slurm_job: JobRecord | None = None, events: AgentEvents | None = None,
              policy: JobPolicy = JobPolicy(), interval: tuple[int, bool] = (0, True),
              store_outage: str | None = None, final_window: FinalWindow | None = None) -> Agent:
        """The agent of one task, its parts built whole. `interval`: the shim's seconds and whether the job
        asked for them (--checkpoint-interval) or they are the plugin's default_interval=, which the policy's
        default replaces; `store_outage`: the store did not answer at the start (agent/start.py);
        `final_window`: the time Slurm gives a final capture (agent/start.py)."""
        store = JobStore(Path(config.storage_root), ident.cluster, ident.job)
        store.ensure()
        store_policy = StorePolicy.from_config(config)
        srun_relay = relay_path(config, ident) if ident.step == "batch" else None
        # The job instance, from slurmctld by the trusted job id (instance.py); None: Slurm did not answer
        instance = None if slurm_job is None else JobInstance(
            ident.cluster, ident.job, ident.uid, ident.gid, slurm_job.submit_time, ident.restart_count)
        store_note = claim(store, instance) if instance else None
        if store_note:
            log.warning("%s", store_note)
        # from now on no older run of the job commits (storage.py: a late commit of a run cut off by a requeue)
        try:
            run = store.enter_run(ident.restart_count)
            if run > ident.restart_count:
                log.warning("run %d of the job has started already: this run (%d) commits nothing", run,
                            ident.restart_count)
        except StorageError as e:       # this run's first commit enters it instead
            log.warning("cannot record run %d in the store: %s", ident.restart_count, e)
        reporter = FailureReporter(store, ident.job, rank_name(ident.step, ident.rank), socket.gethostname(),
                                   annotate=events.note if events else _no_note,
                                   on_recorded=events.capture_failed if events else None)
        facts = TaskFacts(ident, config, store, instance, slurm_job, store_note, events, policy, reporter)
        tree: TaskTree | None = None

        def tree_procs() -> Path:       # the plan names the tree's cgroup, wherever Slurm placed it since
            assert tree is not None
            return tree.cgroup.path / "cgroup.procs"
        plan = TaskPlan(facts, tree_procs, policy.interval(*interval), srun_relay, store_outage)
        tree = TaskTree.start(facts, plan, peer, store_policy)
        return cls(facts, channel, peer, plan, tree, EpochControl(facts, plan, tree, final_window),
                   JobOperations(facts))

    # ---- loop ----------------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                message, fds = self.channel.recv()
            except EOFError:
                break
            except ProtocolError as e:    # the stream can't be trusted any more: stop serving this peer
                log.warning("rejected frame, closing the channel: %s", e)
                self._reply_error(e)
                break
            try:
                self.peer.require()        # serve the wrapper, never a process that inherited its socket
                reply = self.operation(message.get("op"))(message, fds) or {}
                self.channel.send({"ok": True, **reply})
            except SlurmckptError as e:
                log.error("%s failed: %s", message.get("op"), e)
                self._reply_error(e, self.epochs.failed_stage(message))
            except Exception as e:  # the agent boundary: report, never die with the tree frozen
                log.exception("%s crashed", message.get("op"))
                self._reply_error(SlurmckptError(f"{type(e).__name__}: {e}"), self.epochs.failed_stage(message))
            finally:
                for fd in fds:
                    os.close(fd)
        self.shutdown()

    def operation(self, op: object) -> Operation:
        """The handler of `op`, the name the wrapper sent; any other value is refused."""
        handler = self.operations.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ProtocolError(f"unknown operation {op!r}")
        return handler

    def _reply_error(self, e: SlurmckptError, stage: str = "") -> None:
        try:
            self.channel.send({"ok": False, "error": str(e), "error_type": type(e).__name__,
                               **({"stage": stage} if stage else {})})
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wrapper gone: what is left of the tree is ended (tree.py), the last word told."""
        self.tree.end()
        if self.facts.reporter:              # its AdminComment may still be on its way to slurmctld
            self.facts.reporter.flush()
        if self.facts.events:
            self.facts.events.stopped()

    def hello(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        i = self.facts.ident
        return {"job": i.job, "step": i.step, "rank": i.rank, "cluster": i.cluster,
                "restart_count": i.restart_count, "node": socket.gethostname()}


def _no_note(job: int, text: str) -> str:
    log.warning("no outlet for the job's comment (agent built without events): %s", text)
    return "none"
