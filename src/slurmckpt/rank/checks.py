"""The capture's `check` stage: what could not be restored is refused before anything is locked or frozen,
named, so that users can act on it (docs/architecture.md, docs/mpi.md, docs/limitations.md). Each rank is
dumped and restored by its own criu run: what its tree shares with another tree is refused where that cannot
come back consistently (ipc.py says which and why); TCP is sorted by where its other end is."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from slurmckpt.rank.sharing import crossnode
from slurmckpt.rank import ghost
from slurmckpt.rank.sharing import ipc
from slurmckpt.rank.sharing import netlock
from slurmckpt.rank.sharing import shm_files
from slurmckpt.node import procfs, proctree
from slurmckpt.errors import CaptureError
from slurmckpt.identity import TreeName

if TYPE_CHECKING:
    from slurmckpt.rank.context import CaptureState, RankContext

log = logging.getLogger("slurmckpt.rank")


def check_restorable(ctx: RankContext, st: CaptureState) -> None:
    """Refuse, before anything is frozen, what could not be restored (named, so users can act on it)."""
    pids = ctx.cgroup.pids()
    if st.replay:     # replayed, not imaged: srun's own connections to the step daemons are expected
        _refuse_replayed_batch_talking_to_other_nodes(ctx, pids)
        return
    rings = proctree.io_uring_holders(pids)
    if rings:
        raise CaptureError("; ".join(rings) + ": criu cannot checkpoint io_uring. slurmckpt starts every tree "
                           "with io_uring blocked (io_uring_setup answers EPERM; libuv and liburing users then "
                           "go on without) unless the job set SLURMCKPT_IO_URING=allow or the site turned "
                           "block_io_uring off (docs/gpu.md, \"io_uring\")", step=ctx.step, rank=ctx.rank)
    # Each rank is dumped and restored by its own criu run: what it shares with another tree is refused
    # where that cannot come back consistently (ipc.py says which and why).
    stdio = {t.link for t in (proctree.fd_target(ctx.root_pid or 0, fd) for fd in (0, 1, 2)) if t}
    if ctx.handovers.pmi_fd >= 0:   # dumped as external and replaced by the new step's at the restore (pmi.py)
        stdio.add(f"socket:[{ctx.handovers.pmi_ino}]")
    stdio |= {f"socket:[{ino}]" for ino in ctx.handovers.standin_inos}    # likewise the srun stand-ins' (srun_relay.py)
    trees = ipc.job_trees(ctx.cgroup.other_trees(), ctx.cgroup.tree.job)   # the job's own, never another job's
    # TCP whose other end the job holds on this node (the tree itself or another rank) is inside the job;
    # to another node of the job it is too (both ends frozen at the barrier, restored on the same nodes:
    # crossnode.py); to anything else (a client, a database) it is dumped and restored closed (_record).
    outside = proctree.outside_tcp(pids, inside=proctree.socket_inodes(list(trees)))
    other_nodes = ctx.job_addresses() if outside else set()
    # Sorted here, while every rank's tree still runs: in a final capture a rank's dump ends its tree, so by
    # the time another rank records its connections the peer's sockets may be gone (tcp_leaving_the_node)
    st.tcp_outside = {c.inode: c.remote_ip in other_nodes for c in outside}
    closed = [str(c) for c in outside if c.remote_ip not in other_nodes]
    if closed:
        log.info("capturing with connection(s) to outside the job, restored closed: %s", ", ".join(closed))
    shared = ipc.unshareable(pids, {pid: name.label for pid, name in trees.items()}, stdio)
    if shared:
        raise CaptureError("state shared outside this rank's process tree cannot be restored: "
                           + "; ".join(shared), step=ctx.step, rank=ctx.rank)
    # Deleted files the tree still uses: refused here, before the freeze, when above the cap; sized again
    # once frozen (_record), since the tree runs on until then.
    ghost.limit_for(proctree.deleted_files(pids), ctx.limits.ghost_limit_max, step=ctx.step, rank=ctx.rank)
    _refuse_relinked_files(ctx, pids)
    # What this rank shares with other ranks of the job, seen while every rank still runs (a final capture's
    # dump ends the tree it dumped): TCP on this node, held at restore until both ends are back (netlock.py);
    # files mapped shared, fingerprinted at the capture and compared before the restore (ipc.py).
    peers = {pid: (name.step, name.rank) for pid, name in trees.items()}
    st.tcp_peers = netlock.internal_connections(pids, peers)
    if st.tcp_peers or any(st.tcp_outside.values()):     # this rank's restore holds some: count the node's
        _refuse_more_held_tcp_than_the_cap(ctx, pids, trees)
    _refuse_replayed_peers(ctx, st, trees)
    st.shared_files = ipc.shared_files(pids, set(peers))
    # What the CUDA checkpoint API cannot capture (MPS, MIG, managed memory, CUDA IPC, NCCL's intra-node
    # transports), from /proc alone: named here, before the GPU lock (cuda/procscan.py, cuda/ipc_peers.py)
    gpu = ctx.gpu.refusals(pids)
    if gpu:
        raise CaptureError("GPU state cannot be checkpointed: " + "; ".join(gpu), step=ctx.step, rank=ctx.rank)


def _refuse_relinked_files(ctx: RankContext, pids: list[int]) -> None:
    """A file held by a removed name while another name of it remains can be dumped only by making a new
    name for it in the directory the removed name was in, a directory the job's user controls (criu's
    --link-remap), and restored from periodic images only if that name is still there. In /dev/shm
    (sem_open's semaphores) slurmckpt saves such files itself and hands them to criu at the restore
    (sharing/shm_files.py); anywhere else it is refused here, by name (docs/security.md, "Names criu
    makes")."""
    found = proctree.relinked_files(pids, except_dev=shm_files.shm_dev())
    if not found:
        return
    named = "; ".join(f"pid {f.pid} ({_comm(f.pid)}) holds {f.path} by a removed name while the file keeps "
                      "another name" for f in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    raise CaptureError(f"{named}{more}: criu can checkpoint such a file only by making a new name for it in "
                       "that directory; outside /dev/shm this is not done. Close the file before removing "
                       "its name, or keep the name until the program ends", step=ctx.step, rank=ctx.rank)


def _comm(pid: int) -> str:
    try:
        return f"{procfs.comm(pid)}, {procfs.exe(pid) or '?'}"
    except OSError:
        return "gone"


def _refuse_more_held_tcp_than_the_cap(ctx: RankContext, pids: list[int], trees: dict[int, TreeName]) -> None:
    """A restore holds every connection between the job's ranks while only one end is back (netlock.py,
    crossnode.py), at most tcp_hold_max per job and node: a capture whose restore would need more is refused
    now, while the job can still run on, rather than a restore that cannot hold them."""
    here, to_nodes = netlock.held_on_node(pids, trees, ctx.job_addresses)
    if here + to_nodes > ctx.limits.tcp_hold_max:
        raise CaptureError(f"the job's ranks hold {here + to_nodes} TCP connections on this node ({here} between "
                           f"ranks here, {to_nodes} to ranks on other nodes), above tcp_hold_max "
                           f"({ctx.limits.tcp_hold_max}): a restore holds each of them while only one end is back, "
                           "and no more than that per job and node (docs/mpi.md, \"TCP inside the job\")",
                           step=ctx.step, rank=ctx.rank)


def _refuse_replayed_peers(ctx: RankContext, st: CaptureState, trees: dict[int, TreeName]) -> None:
    """TCP to a batch step that runs srun: such a batch step is replayed on requeue (its script runs again
    from the top), not restored, so its end of the connection would start afresh while this one is restored.
    That is OpenMPI's mpirun starting its daemons (orted) through srun (docs/mpi.md)."""
    to_batch = [f"{c[0]} -> {c[1]}" for c in st.tcp_peers if c[2] == "batch"]
    if not to_batch:
        return
    batch = [pid for pid, name in trees.items() if name.step == "batch"]
    if proctree.has_slurm_client(batch):
        raise CaptureError(f"TCP connection(s) {', '.join(to_batch)} to the batch step, which is running srun: "
                           "a batch step running srun is replayed on requeue, not restored, so its end would "
                           "start again while this one is restored (OpenMPI's mpirun starting orted through "
                           "a real srun does this: slurmckpt's srun stand-in, first in the batch step's PATH, "
                           "avoids it); on one node let mpirun start the ranks itself (`--mca plm ^slurm "
                           "--mca ras ^slurm`) (docs/mpi.md)",
                           step=ctx.step, rank=ctx.rank)


def _refuse_replayed_batch_talking_to_other_nodes(ctx: RankContext, pids: list[int]) -> None:
    """The batch step runs srun, so it is replayed on requeue (its script runs again from the top) while
    the steps' ranks are restored: a process of it (other than srun itself) with TCP to another node of the
    job talks to a rank there, which would be restored while this end starts afresh. That is OpenMPI's
    mpirun starting orted on the other nodes through srun (docs/mpi.md)."""
    mine = [pid for pid in pids if proctree.exe_name(pid) not in ("srun", "sattach")]
    outside = proctree.outside_tcp(mine)
    nodes = ctx.job_addresses() if outside else set()
    to_nodes = [str(c) for c in outside if c.remote_ip in nodes]
    if to_nodes:
        raise CaptureError(f"TCP connection(s) {', '.join(to_nodes)} from the batch step, which is running srun, "
                           "to ranks on other nodes of the job: a batch step running srun is replayed on "
                           "requeue, not restored, so its end would start again while the other is restored "
                           "(OpenMPI's mpirun starting orted through a real srun does this: slurmckpt's srun "
                           "stand-in, first in the batch step's PATH, avoids it) (docs/mpi.md)",
                           step=ctx.step, rank=ctx.rank)


def tcp_leaving_the_node(st: CaptureState, pids: list[int]) -> tuple[tuple[tuple[str, str], ...], tuple[int, ...]]:
    """TCP whose other end is not on this node, as the check sorted it (st.tcp_outside) and still established
    now (the tree is frozen): to another node of the job (restored as dumped, held until both ends are
    back: crossnode.py), or to outside the job (its other end goes on without the job, so it is restored
    closed). A connection the check did not see (opened between the check and the freeze) is restored as
    dumped: closing one of the job's own connections by mistake would lose its data. Returns the record's
    (tcp_nodes, tcp_close)."""
    now = {c.inode: c for c in proctree.outside_tcp(pids)}
    to_nodes = [now[i] for i, job_node in st.tcp_outside.items() if job_node and i in now]
    return (tuple((lo, re) for lo, re in crossnode.job_connections(to_nodes, {c.remote_ip for c in to_nodes})),
            tuple(sorted(i for i, job_node in st.tcp_outside.items() if not job_node and i in now)))
