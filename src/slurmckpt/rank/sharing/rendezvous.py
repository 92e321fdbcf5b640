"""Where the ranks of one restore meet (one scheme: `marker(directory, key, *names)`, names `<key>.<...>`):
in the node's own directory (LOCK_DIR, under the job's lock or claimed first-come) for what ranks of a node
share: the TCP holds between them (netlock.py) and the one verdict on a file they share (ipc.py,
shm_files.py); in the job's directory of the shared image store for what ranks on different nodes share:
"this end is back" of a connection between nodes (crossnode.py). Two directories because a lock on the
node must never wait on a shared file system, and nodes see only the shared one.
"""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from slurmckpt.node import procfs

LOCK_DIR = Path("/run/slurmckpt/restore-sync")     # jobs' locks and per-restore markers


def marker(directory: Path, key: object, *names: str) -> Path:
    """The marker `names` of the restore `key` (a RestoreKey on a node; restart.epoch between nodes)."""
    return directory / ".".join([str(key), *names])


@dataclass(frozen=True)
class RestoreKey:
    """Names one restore of a job's epoch on one node (network namespace: test clusters run several slurmds,
    one per namespace, on one host), the same for every rank that takes part in it: the prefix of every
    marker that ranks restored on this node meet at (`str(key)`, `job.restart.epoch.netns`)."""
    job: int
    restart: int
    epoch: int
    netns: int

    def __str__(self) -> str:
        return f"{self.job}.{self.restart}.{self.epoch}.{self.netns}"

    @classmethod
    def parse(cls, text: str) -> RestoreKey | None:
        """The key a marker's name starts with (its first four fields); None if it is not one."""
        parts = text.split(".", 4)[:4]
        if len(parts) != 4 or not all(x.isdigit() for x in parts):
            return None
        return cls(*map(int, parts))

    def same_restart(self, other: RestoreKey) -> bool:
        return self.restart == other.restart


def restore_key(job: int, restart: int, epoch: int) -> RestoreKey:
    """This node's (network namespace's) key for restoring `epoch` of `job` in its start `restart`."""
    try:
        netns = procfs.namespace("self", "net")
    except OSError:
        netns = 0
    return RestoreKey(int(job), int(restart), int(epoch), netns)


def job_lock_path(lock_dir: Path, job: int) -> Path:
    return lock_dir / f".lock-{int(job)}"


@contextmanager
def job_lock(job: int, lock_dir: Path = LOCK_DIR) -> Iterator[None]:
    """Serialises the changes to one job's TCP holds on this node (netlock.py, crossnode.py, the job's end
    and gc): short bookkeeping and one packet filter batch, never a wait on a user's path. Only that job's
    ranks wait for it: no other job's restore does (docs/security.md, "Blocking and node-wide locks")."""
    lock_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(job_lock_path(lock_dir, job), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def locked_jobs(lock_dir: Path = LOCK_DIR) -> set[int]:
    """The jobs that took their lock on this node (host): each made TCP holds here at some time."""
    try:
        names = [p.name for p in lock_dir.iterdir()]
    except OSError:
        return set()
    return {int(n[6:]) for n in names if n.startswith(".lock-") and n[6:].isdigit()}


# ---- one verdict per restore of the node ------------------------------------------------------------------
# Ranks of one node that share a file (a /dev/shm segment, a file mapped shared) each recorded it at the
# cut; its check or write-back is done once per restore of the node, by the first rank, and the others take
# its verdict (the ranks restored first already use the file again). That work touches the user's paths, so
# no lock is held around it: the marker is claimed by creating it (O_EXCL), the work runs, and its verdict
# replaces the marker (rename). Only the ranks of the same restore wait for it.


def first_on_node(marker: Path, work: Callable[[], str], wait_s: float, poll_s: float = 0.05,
                  clock: Callable[[], float] = time.monotonic) -> tuple[str, bool]:
    """(verdict, whether this caller ran `work`) for `marker` (a name in LOCK_DIR under restore_key).
    The first caller runs `work` and records what it returns ("ok" or why not); a failure of `work` is
    recorded as a verdict too, and raised. The others wait for the verdict at most `wait_s`."""
    marker.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        return _verdict_of(marker, wait_s, poll_s, clock), False
    try:
        verdict = work()
    except BaseException as e:
        _record(marker, f"failed on the rank restored first on this node: {e}")
        raise
    _record(marker, verdict)
    return verdict, True


def _record(marker: Path, verdict: str) -> None:
    tmp = marker.with_name(f".{marker.name}.tmp.{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_text(verdict or "?")
    os.rename(tmp, marker)


def _verdict_of(marker: Path, wait_s: float, poll_s: float, clock: Callable[[], float]) -> str:
    deadline = clock() + wait_s
    while True:
        try:
            verdict = marker.read_text()
        except FileNotFoundError:       # lifted meanwhile (_lift_stale of a later restart)
            return "its marker was removed by a later start of the job"
        if verdict:             # empty: claimed, the work still running
            return verdict
        if clock() >= deadline:
            return f"the rank restored first on this node gave no verdict within {wait_s:.0f}s"
        time.sleep(poll_s)
