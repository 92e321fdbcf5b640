"""The task's output files, kept across a restore (docs/storage.md, "What a capture copies").

Slurm truncates the job's output file on requeue (without --open-mode=append), and the restored tree goes on
writing where it was. So the capture copies the wrapper's stdout/stderr files (when Slurm gave it regular
files) up to their size at the freeze, and the restore rewrites the new task's files to exactly that: the
job's output holds everything exactly once.

The file and the fd are the user's: the content is read through the wrapper's fd reopened as the user
(asuser.py), never through /proc as root; only its data ranges are copied (sparse.py: `truncate -s 1T` on the
output costs the user nothing and the copy nothing either), each charged to the capture's budget of copied
bytes (space.CopyBudget), counted and reserved in PREPARE (`measure`). The restore puts the ranges back at
their offsets: holes stay holes.
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Sequence, TYPE_CHECKING

from slurmckpt.node import procfs
from slurmckpt.store import sparse
from slurmckpt.node import asuser
from slurmckpt.node import proctree
from slurmckpt.errors import CaptureError, RestoreError
from slurmckpt.store.record import OutputSnapshot

if TYPE_CHECKING:
    from slurmckpt.rank.context import CaptureState, RankContext

FDS = (1, 2)


def measure(wrapper_pid: int) -> list[tuple[str, int]]:
    """(name, bytes it holds) of each distinct regular output file of the wrapper: what `take` will copy,
    by allocated bytes (stat through the fd: root reads no path of the user)."""
    out: dict[str, int] = {}
    for fd in FDS:
        t = proctree.fd_target(wrapper_pid, fd)
        if t is None or not t.regular or t.link in out:
            continue
        try:
            out[t.link] = sparse.allocated(procfs.fd_stat(wrapper_pid, fd))
        except OSError:
            continue
    return list(out.items())


def take(ctx: RankContext, st: CaptureState, where: Path) -> tuple[OutputSnapshot, ...]:
    """CAPTURE (every rank frozen): the output files' data up to their size at
    the freeze into `where`; the rank record's `outputs`."""
    if st.replay:
        _wait_settled(ctx.wrapper_pid)
    outputs: list[OutputSnapshot] = []
    seen: dict[str, tuple[str, list[list[int]]]] = {}
    for fd in FDS:
        t = proctree.fd_target(ctx.wrapper_pid, fd)
        if t is None or not t.regular:
            continue
        if t.path_only:
            raise CaptureError(f"the task's fd {fd} is an O_PATH descriptor ({t.link}): its output cannot be "
                               "kept across a restore", step=ctx.step, rank=ctx.rank)
        if t.link not in seen:
            seen[t.link] = (f"output-{fd}.snap", _copy(ctx, st, fd, t, where / f"output-{fd}.snap"))
        snapshot, ranges = seen[t.link]
        outputs.append(OutputSnapshot(fd, t.link, t.size, snapshot, tuple((a, b) for a, b in ranges)))
    if ctx.peer_alive and not ctx.peer_alive():
        raise CaptureError("the task's wrapper exited during the capture", step=ctx.step, rank=ctx.rank)
    return tuple(outputs)


def _copy(ctx: RankContext, st: CaptureState, fd: int, t: proctree.FdTarget, dst: Path) -> list[list[int]]:
    # Reopened through the wrapper's fd link, as the user: the kernel checks the user's read permission on
    # the file itself (an O_PATH or write-only fd to a file the user cannot read gives nothing).
    src = asuser.open_expected(ctx.creds, str(procfs.path(ctx.wrapper_pid, "fd", fd)), os.O_RDONLY, t.dev, t.ino,
                               f"the task's fd {fd} ({t.link}),")
    try:
        return sparse.copy_data(src, dst, t.size, lambda n: st.copy_budget.charge(n, t.link, t.size), t.link)
    except OSError as e:
        raise CaptureError(f"output file {t.link}: {e.strerror or e}", step=ctx.step, rank=ctx.rank) from e
    finally:
        os.close(src)


def _wait_settled(wrapper_pid: int, quiet_s: float = 1.5, limit_s: float = 10.0) -> None:
    """Every step rank is frozen by now; what they wrote before still travels through slurmstepd and srun
    to the batch output file. Wait until the file stops growing, so the snapshot holds all of it. A quiet
    time, not a count: slurmstepd's and srun's own buffers cannot be seen from here. 0.5 s was too short on
    the 2-core CI machine (a ring step's line arrived later and was missing from the restored output)."""
    def size() -> int:
        try:
            return procfs.fd_stat(wrapper_pid, 1).st_size
        except OSError:
            return -1
    start = time.monotonic()
    last, since = size(), time.monotonic()
    while time.monotonic() - start < limit_s and time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = size()
        if now != last:
            last, since = now, time.monotonic()


def rewrite(outputs: Sequence[OutputSnapshot], images: Path, stdio: list[int]) -> None:
    """Restore: each output fd of the new task (Slurm's fresh file) made to hold the snapshot, holes where
    the file had holes (snapshots without `ranges`, from before they were kept, hold every byte)."""
    done = set()
    for entry in outputs:
        if entry.snapshot in done:
            continue
        fd = stdio[entry.fd]
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RestoreError(f"the task's fd {entry.fd} is not a regular file now (it was "
                               f"{entry.link} at the capture): cannot restore its output")
        ranges = None if entry.ranges is None else [list(r) for r in entry.ranges]
        with open(images / entry.snapshot, "rb") as f:
            sparse.write_back(fd, f.fileno(), ranges, entry.size)
        done.add(entry.snapshot)
