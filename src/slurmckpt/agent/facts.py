"""What the agent learnt about its task when it started (agent/service.py builds it once; every part of the
agent reads it): who the task is, the site's config and policy for it, the job's store and instance, and its
outlets. The parts keep their own state (plan.py, tree.py, epochs.py, job.py); none of it lives here."""
from __future__ import annotations

from dataclasses import dataclass, field

from slurmckpt.agent.events import AgentEvents
from slurmckpt.config import Config
from slurmckpt.errors import SlurmckptError
from slurmckpt.identity import TaskIdentity
from slurmckpt.policy import JobPolicy
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.store.fresh_start import FailureReporter
from slurmckpt.store.instance import JobInstance
from slurmckpt.store.jobstore import JobStore


@dataclass
class TaskFacts:
    ident: TaskIdentity
    config: Config
    store: JobStore
    instance: JobInstance | None = None      # the job instance from slurmctld (instance.py); None: it did not say
    slurm_job: JobRecord | None = None
    store_note: str | None = None            # a foreign store moved aside when the agent claimed it
    events: AgentEvents | None = None        # slurmd's log, metrics, the job's comment and summary (events.py)
    policy: JobPolicy = field(default_factory=JobPolicy)   # the site policy for the job's partition and QOS (policy.py)
    reporter: FailureReporter | None = None  # capture failures recorded and told (fresh_start.py)

    def failures(self) -> FailureReporter:
        """The capture failures' recorder, set up with the agent (agent/start.py)."""
        if self.reporter is None:
            raise SlurmckptError("the agent has no failure reporter (started without its outlets)")
        return self.reporter

    @property
    def task_name(self) -> str:
        return self.ident.tree.task

    def job_nodes(self) -> int:
        return max(1, len(self.slurm_job.nodes)) if self.slurm_job else 1
