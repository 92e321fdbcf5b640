"""The agent's job-wide operations, asked by the wrapper that hosts the job's coordinator or for it: epoch
numbers, commits, a withdrawn epoch, the coordinator's address, the partition's interruptions and the
automatic interval it chose (service.py serves them)."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from slurmckpt.agent.facts import TaskFacts
from slurmckpt.store.fresh_start import coordinator_verdict
from slurmckpt.store.instance import claim
from slurmckpt.store import handover, lease
from slurmckpt.agent.interruptions import PartitionHistory, QUERY_TIMEOUT_S
from slurmckpt.agent.interruptions import answer as interruption_answer
from slurmckpt.store import summary
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.store.jobstore import atomic_write_json, rank_name
from slurmckpt import validate

log = logging.getLogger("slurmckpt.agent")


def message_epoch(m: dict[str, Any]) -> int:
    return validate.epoch(m.get("epoch"))


_epoch = message_epoch


class JobOperations:
    """The job-wide operations; its own state: the partition's interruption history, once asked for."""

    def __init__(self, facts: TaskFacts) -> None:
        self.facts = facts
        self.history: PartitionHistory | None = None

    def interruptions(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The job's mean time between interruptions for its coordinator's automatic interval, from this node's
        cache of the partition's history in accounting (interruptions.py); never waits for accounting."""
        config, job = self.facts.config, self.facts.slurm_job
        if self.history is None:
            self.history = PartitionHistory(Path(config.run_dir) / "interruptions", self.facts.ident.cluster,
                                            job.partition if job else "", config.interruption_window,
                                            config.interruption_states,
                                            CliSlurm(timeout_s=QUERY_TIMEOUT_S).partition_runs)
        return interruption_answer(*self.history.current(), config.interruption_mtbi, self.facts.job_nodes(),
                                   config.interruption_window)

    def interval_chosen(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The automatic interval the coordinator of this task's wrapper chose, with its inputs: kept in the
        job's store (checked and bounded: summary.interval_record) for `slurmckpt status` and the next run.
        The user's own numbers about the user's own job; the minimum is enforced at PREPARE whatever they say."""
        summary.record_interval(self.facts.store, m.get("choice"))
        if self.facts.events:
            self.facts.events.publish_soon()
        return {}

    def capture_failed(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The job's coordinator aborted an epoch (its verdict, relayed by the wrapper hosting it): recorded
        unless a rank's agent recorded that epoch itself. It only informs: nothing acts on it."""
        self.facts.failures().capture_failed(**coordinator_verdict(m))
        return {}

    def commit(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        ranks = validate.commit_ranks(m.get("ranks"))
        reason = validate.label(m.get("reason", "unknown"), "reason")
        # A foreign store copied in meanwhile is moved aside; without a known instance the commit stays
        # unbound, which no restore accepts (and the next bound agent moves aside).
        instance = self.facts.instance
        note = claim(self.facts.store, instance, keep_epoch=_epoch(m)) if instance else None
        if note:
            log.warning("%s", note)
        if validate.flag(m.get("final", False), "final"):
            # every rank dumped into its staging and handed its images to a persister that outlives the job:
            # the epoch commits once they are all in the store (store/handover.py), maybe right now
            done = handover.pend(self.facts.store, _epoch(m), ranks, reason, self.facts.ident.restart_count,
                                 self.facts.config.keep_epochs)
            log.info("final epoch %d (%s) handed over with %d ranks%s", _epoch(m), reason, len(ranks),
                     ": committed" if done else "; it commits once every rank's images are in the store")
            if self.facts.events:
                self.facts.events.handed_over(_epoch(m), reason, ranks, done)
            return {"committed": done}
        self.facts.store.commit(_epoch(m), ranks, reason, self.facts.config.keep_epochs,
                                run=self.facts.ident.restart_count)
        threading.Thread(target=self.facts.store.empty_trash, daemon=True).start()
        log.info("committed epoch %d (%s) with %d ranks", _epoch(m), reason, len(ranks))
        if self.facts.events:
            self.facts.events.committed(_epoch(m), reason, ranks, final=self.facts.failures().epoch[1] is True)
        return {}

    def allocate_epoch(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """A new epoch number for the coordinator this task's wrapper hosts: unique across the job's steps
        and coordinators (storage.allocate_epoch), refused to an older run than the store's. Its lease covers
        every phase the epoch may still take at the configured limits (the ranks extend it: lease.py)."""
        at_least = validate.integer(m.get("at_least", 1), "at_least", 1, validate.MAX_EPOCH)
        epoch = self.facts.store.allocate_epoch(at_least, lease.base_s(self.facts.config),
                                                f"{socket.gethostname()}:{self.facts.task_name}",
                                                run=self.facts.ident.restart_count)
        if validate.flag(m.get("final", False), "final"):      # what the next run says if it is lost
            handover.began(self.facts.store, epoch, self.facts.ident.restart_count)
        return {"epoch": validate.epoch(epoch)}

    def reject_epoch(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """This rank could not restore the epoch: no rank of the job may restore it (one consistent cut)."""
        epoch, why = _epoch(m), validate.text(m.get("reason", ""), "reason")
        rejected = self.facts.store.reject(epoch, f"rank {self.facts.task_name} could not restore it: {why}"[:500])
        log.warning("epoch %d rejected for the whole job (%r)", epoch, why[:500])
        if self.facts.events:
            self.facts.events.withdrawn(epoch, f"rank {self.facts.task_name} could not restore it: {why}")
        return {"rejected": rejected}

    def publish_coordinator(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        address = {"host": validate.ip_address(m.get("host")), "port": validate.port(m.get("port")),
                   "token": validate.token(m.get("token")),
                   "restart_count": self.facts.ident.restart_count,
                   "published_by": rank_name(self.facts.ident.step, self.facts.ident.rank)}
        atomic_write_json(self._coordinator_file(m.get("scope", "job")), address)
        return {}

    def lookup_coordinator(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The job's coordinator address, from a root-owned file only this job's agents read."""
        deadline = time.monotonic() + validate.wait_s(m.get("wait_s", 0))
        path = self._coordinator_file(m.get("scope", "job"))
        while True:
            try:
                address = json.loads(path.read_text())
                if address["restart_count"] == self.facts.ident.restart_count:
                    return {"found": True, **address}
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() >= deadline:
                return {"found": False}
            time.sleep(0.2)

    def _coordinator_file(self, scope: object) -> Path:
        scope = validate.scope(scope)
        return self.facts.store.job_dir / f"coordinator-{scope}.json"
