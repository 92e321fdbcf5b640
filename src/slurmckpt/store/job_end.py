"""A finished job's images go at its end (docs/storage.md, "When a job ends").

The SPANK plugin's job epilog (spank/job_end.c: slurmd runs it as root on every node of a job each time the
job leaves its nodes, whether it ended, was requeued or preempted) starts `slurmckpt job-end` detached, with
the job id and uid from Slurm, the node's name and the job's node list from slurmd, a fixed environment,
and returns at once. On every node it first lifts the TCP holds the job still has there (a restore killed
before both ends of a connection were back leaves them: rank/leftovers.py): the job has left the node, and
its next start cannot come back to it before every node's epilog has returned and the requeue delay has
passed. Then only the first node of the job's list goes on (the others exit): one process per job asks
slurmctld, whatever the job's size.

While the epilogs run, slurmctld shows the job COMPLETING whether it ended or is being requeued; its final
word comes once every node's epilog has returned. So this asks again (about this job alone: slurm/control.py,
job_states), bounded (WAIT_S), until `reclaim.verdict` reads a final word: finished -> the whole store goes
(`reclaim.remove_finished`, under the job's lock, the summary kept and saying so); runs again (requeued,
preempted and requeued, held) -> kept; no final word in time, or no answer from slurmctld -> left to
`slurmckpt gc`, the safety net (docs/operations.md, "Packaging": a timer or cron entry on every node).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from slurmckpt.store import reclaim
from slurmckpt.config import Config
from slurmckpt.errors import SlurmError, StorageError
from slurmckpt.store.instance import bound_uid
from slurmckpt.slurm.jobrecord import expand_hostlist
from slurmckpt.store.jobstore import JobStore
from slurmckpt.sizes import size_text

log = logging.getLogger("slurmckpt.job_end")

WAIT_S = 120.0                         # then gc decides
PAUSES = (1.0, 1.0, 2.0, 3.0, 5.0)     # between two questions to slurmctld; the last one repeats


class Slurm(Protocol):
    def cluster_name(self) -> str | None: ...
    def job_states(self, job_ids: list[int]) -> dict[int, str]: ...


@dataclass(frozen=True)
class JobEnd:
    """What the plugin passed (spank/job_end.c), as trusted as Slurm itself."""
    job: int
    uid: int
    node: str = ""         # slurmd's SLURMD_NODENAME ("": not known)
    nodes: str = ""        # slurmd's SLURM_NODELIST, a Slurm hostlist ("": not known)

    def acts_here(self) -> bool:
        """The first node of the job acts; every node does when the list is missing or reads without this
        node in it (a hostlist form expand_hostlist does not know): the store's lock keeps the removal
        single."""
        if not self.node or not self.nodes:
            return True
        try:
            names = expand_hostlist(self.nodes)
        except ValueError:
            return True
        return self.node not in names or names[0] == self.node


def end(job: JobEnd, config: Config, slurm: Slurm, lift_holds: Callable[[int], object],
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str:
    """Lift the job's TCP holds on this node (`lift_holds`: rank/leftovers.py lift_tcp_holds); then wait for
    Slurm's final word on the job and act on it; what was done, in one line (also logged)."""
    lift_holds(job.job)
    if not job.acts_here():
        return f"left to the job's first node ({job.nodes})"
    try:
        cluster = slurm.cluster_name() or "cluster"
    except SlurmError as e:
        return _said(logging.WARNING, f"left to gc: Slurm did not name the cluster ({e})")
    store = JobStore(Path(config.storage_root), cluster, job.job)
    if not store.job_dir.is_dir():
        return "no images in the store"
    owner = bound_uid(store)
    if owner is not None and owner != job.uid:
        return _said(logging.WARNING, f"left to gc: the store is bound to uid {owner}, Slurm's job to uid {job.uid}")
    deadline = clock() + WAIT_S
    pauses = iter(PAUSES)
    while True:
        try:
            state = slurm.job_states([job.job]).get(job.job)
            said, detail = reclaim.verdict(state), f"job {state}"
        except SlurmError as e:
            said, detail = "no answer", f"slurmctld did not answer ({e})"
        if said == "finished":
            try:
                removal = reclaim.remove_finished(store, str(state), config.keep_finished,
                                                  summary_dir=config.summary_dir)
            except StorageError as e:
                return _said(logging.WARNING, f"left to gc: {detail}, but {e}")
            verb = "removed" if removal.kind == "finished-job" else "kept"
            return _said(logging.INFO, f"{verb} {size_text(removal.bytes)} of images: {removal.why}")
        if said == "runs-again":
            return _said(logging.INFO, f"images kept: {detail}, it runs again")
        if clock() >= deadline:
            return _said(logging.WARNING, f"left to gc: no final word from Slurm within {WAIT_S:.0f}s ({detail})")
        sleep(next(pauses, PAUSES[-1]))


def _said(level: int, text: str) -> str:
    log.log(level, "job end: %s", text)
    return text
