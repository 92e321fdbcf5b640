"""One rank's restore as the named stage table RESTORE, run by the engine (engine.py) over the restore's
RestoreState (context.py), the mirror of capture.py
(docs/architecture.md, "Restore on requeue"):

    gpu-check (the target GPUs, before anything is unpacked or touched) -> unpack (verify the images into
    staging: images.py) -> host-copy-ahead (the GPU host copy's files start coming into the page cache,
    beside what follows: host_copy.py) -> shared-files (files mapped shared with other ranks unchanged: sharing/ipc.py)
    -> output (the snapshot written back) -> truncate (files the tree writes cut back) -> shm (/dev/shm
    files written back: sharing/shm_files.py) -> handovers (stdio, batch script, PMI and srun stand-in
    sockets in the old ones' places) -> tcp-hold (TCP to other nodes held: sharing/crossnode.py) -> criu
    (criu restore into the task cgroup, TCP to other ranks of the node held: sharing/netlock.py;
    connections to outside the job restored closed) -> host-copy (the GPU host copy the capture saved
    itself, back into the stopped processes: host_copy.py) -> tcp-release -> gpu-restore (+ remap, unlock).

A replayed batch step stops after `output`. A failure undoes what was done in reverse: above all, once criu
brought the tree back, the tree is killed and waited for, so that the wrapper's fallback (an older epoch, a
fresh start) finds the task cgroup empty. The staging area goes either way (runner.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
import time
from typing import Any

from slurmckpt.criu.driver import InheritedFd
from slurmckpt.cuda.interface import holds_gpu_state
from slurmckpt.errors import CriuInterrupted, PermissionDenied, RestoreError, SlurmckptError
from slurmckpt.node import asuser, proctree, tcp_ports
from slurmckpt.node.launch import Credentials
from slurmckpt.rank import host_copy, images, output_snapshot
from slurmckpt.rank.context import Phase, RankContext, RestoreState
from slurmckpt.rank.engine import Stage, Table, rollback, run_table
from slurmckpt.rank.sharing import crossnode, ipc, netlock, rendezvous, shm_files
from slurmckpt.slurm import pmi
from slurmckpt.store.record import Capture, Files, WrittenFile

log = logging.getLogger("slurmckpt.rank")


def run(ctx: RankContext, st: RestoreState) -> None:
    """RESTORE's table; on failure its undos, and the first failure raised (naming what undoing met)."""
    try:
        run_table(RESTORE, ctx, st)
    except Exception as error:
        failures = rollback(ctx, st)
        if failures:
            raise RestoreError(f"{error}; then {'; '.join(map(str, failures))}", step=ctx.step,
                               rank=ctx.rank) from error
        raise


def restored(ctx: RankContext, pid: int) -> RankContext:
    """The context of the tree a restore brought back."""
    return dataclasses.replace(ctx, root_pid=pid, standin_fds=())


def _record(st: RestoreState) -> Capture:
    """The capture's record the `unpack` stage read (rank.json, verified)."""
    assert st.manifest is not None
    return st.manifest.capture


def _gpu_check(ctx: RankContext, st: RestoreState) -> None:
    ctx.gpu.check_restore(ctx.store.read_rank_manifest(st.epoch, ctx.step, ctx.rank).capture.gpu.state)


def _unpack(ctx: RankContext, st: RestoreState) -> None:
    images.unpack(ctx, st)
    st.replay = _record(st).tree.kind == "replay"


def _shared_files(ctx: RankContext, st: RestoreState) -> None:
    """Files mapped shared with other ranks hold what they held at the cut, or the restore is refused; a
    /dev/shm file the capture saved is not compared: the `shm` stage writes its saved bytes back (one policy
    for /dev/shm, sharing/shm_files.py), so a crash or another node changes nothing there."""
    st.key = rendezvous.restore_key(ctx.store.job, ctx.cgroup.tree.restart, st.epoch)
    rec = _record(st)
    ipc.check_shared_files(files_to_check(rec.files)[0], st.key, ctx.creds, same_node=rec.tree.node == socket.gethostname())


def _output(ctx: RankContext, st: RestoreState) -> None:
    assert st.images is not None
    output_snapshot.rewrite(_record(st).outputs, st.images, st.stdio)


def _truncate(ctx: RankContext, st: RestoreState) -> None:
    if not st.replay:
        _truncate_written_files(files_to_check(_record(st).files)[1], ctx.creds)


def _shm(ctx: RankContext, st: RestoreState) -> None:
    if st.replay:
        return
    assert st.images is not None
    try:
        files = _record(st).files
        handed = shm_files.put_back(ctx.creds, list(files.shm), st.images, st.key,
                                    shared={e["path"] for e in files.shared})
    except PermissionDenied as err:
        raise RestoreError(f"cannot prepare /dev/shm for the restore: {err}") from err
    st.owned_fds += handed.fds            # closed once the restore is over (runner.py)
    st.inherit += [InheritedFd(key, fd) for key, fd in handed.inherit]


def _handovers(ctx: RankContext, st: RestoreState) -> None:
    """The new start's fds in the old ones' places (criu --inherit-fd)."""
    if st.replay:
        return
    rec, stdio, inherit, seen = _record(st), st.stdio, st.inherit, set()
    for entry in rec.files.stdio:
        if entry.key in seen or not (entry.regular or entry.link.startswith(("pipe:", "socket:"))
                                     or entry.key.startswith("file[")):
            continue
        seen.add(entry.key)
        inherit.append(InheritedFd(entry.key, stdio[entry.fd]))
    if rec.files.batch_script:
        if len(stdio) < 4:
            raise RestoreError("the batch script is open in the checkpoint, but this start passed no script fd")
        for script in rec.files.batch_script:   # one file, one key: every fd on it shares this position
            os.lseek(stdio[3], script.pos, os.SEEK_SET)
            inherit.append(InheritedFd(script.key, stdio[3]))
    pmi_fd = ctx.handovers.pmi_fd
    for sock in rec.sockets.pmi:
        if pmi_fd < 0:
            raise RestoreError("the checkpoint holds a PMI connection to slurmstepd (srun --mpi=pmi2), but "
                               "this start of the task has none (PMI_FD): it was not started by srun --mpi=pmi2")
        inherit.append(InheritedFd(sock.key, pmi_fd))     # the new step's, in the old one's place
    standins = rec.sockets.srun_standins
    if len(standins) != len(ctx.standin_fds):
        raise RestoreError(f"the checkpoint holds {len(standins)} srun stand-in socket(s), this start handed in "
                           f"{len(ctx.standin_fds)}", step=ctx.step, rank=ctx.rank)
    inherit += [InheritedFd(e.key, fd) for e, fd in zip(standins, ctx.standin_fds)]  # the new wrapper's
    if rec.sockets.pmi:
        pmi.reinit(pmi_fd)        # slurmstepd takes a task's first PMI line as its init


def _tcp_hold(ctx: RankContext, st: RestoreState) -> None:
    if st.replay:
        return
    rec = _record(st)
    st.held = netlock.confirmed(rec.sockets.tcp_ranks, ctx.step, ctx.rank,
                               lambda step, rank: ctx.store.read_rank_manifest(st.epoch, step, rank).capture.sockets.tcp_ranks)
    between_nodes = [list(e) for e in rec.sockets.tcp_nodes]
    if between_nodes:
        crossnode.require_local_addresses(between_nodes, proctree.local_addresses(), rec.tree.node or "?")
    hold = st.hold = crossnode.Hold(between_nodes, ctx.store.job_dir / ".tcp-sync",
                                   f"{ctx.cgroup.tree.restart}.{st.epoch}", ctx.store.job, ctx.packets,
                                   ctx.limits.tcp_hold_max)
    tcp_ports.free_for(rec.sockets.tcp_ports)     # a TIME_WAIT on a listening port fails criu's bind
    try:
        hold.before_restore()
    except BaseException:
        hold.release()
        raise


def _tcp_unhold(ctx: RankContext, st: RestoreState) -> None:
    hold = st.hold
    if hold is not None and hold.thread is None:      # once handed to its waiting thread, it lifts itself
        hold.release()


def _criu(ctx: RankContext, st: RestoreState) -> None:
    if st.replay:
        return
    assert st.images is not None and st.key is not None
    rec = _record(st)
    try:
        with netlock.hold_during_restore(st.held, st.key, ctx.packets, ctx.limits.tcp_hold_max):
            st.pid = ctx.criu.restore(st.images, st.inherit, freezer=ctx.cgroup.path, pidfile=st.images / "restore.pid",
                                     join=ctx.cgroup.add, tcp_close=list(rec.sockets.tcp_close),
                                     mntns=rec.tree.mntns, leave_stopped=holds_gpu_state(rec.gpu.state))
    except CriuInterrupted:    # criu did not take back what it had restored: none of it may run
        _end_restored_tree(ctx, st)
        raise


def _read_host_copy_ahead(ctx: RankContext, st: RestoreState) -> None:
    """As soon as the images are there: the saved host copy starts coming into the page cache, so the disk
    reads it beside criu's own images rather than after them (restore-to-running, docs/gpu.md)."""
    entries = list(_record(st).gpu.host_copy)
    if st.replay or not entries:
        return
    assert st.images is not None
    host_copy.read_ahead(entries, st.images)      # its threads end on their own; copy_in never waits for them


def _host_copy_back(ctx: RankContext, st: RestoreState) -> None:
    """The GPU host copy the capture saved itself, back into the restored (stopped) processes before the
    GPU restore reads it (host_copy.py)."""
    entries = list(_record(st).gpu.host_copy)
    if st.replay or not entries:
        return
    assert st.images is not None
    pids = proctree.descendants(st.pid) if st.pid else ctx.cgroup.pids()
    st.timings["host_copy"] = host_copy.copy_in(entries, st.images, pids, max(1, ctx.limits.host_copy_threads),
                                                step=ctx.step, rank=ctx.rank, epoch=st.epoch)


def _tcp_release(ctx: RankContext, st: RestoreState) -> None:
    hold = st.hold
    if hold is not None:
        hold.after_restore()


def _gpu_restore(ctx: RankContext, st: RestoreState) -> None:
    """After criu: the tree is back, and stopped if it holds GPU state, which is restored before it runs
    again. Without its GPU state it must not run on (the undo of `criu` kills it)."""
    if st.replay:
        return
    try:
        pid = st.pid
        ctx.gpu.restore(_record(st).gpu.state, proctree.descendants(pid) if pid else ctx.cgroup.pids())
    except SlurmckptError:
        raise
    except Exception as e:
        raise RestoreError(f"GPU restore failed: {e}", step=ctx.step, rank=ctx.rank) from e


def _end_restored_tree(ctx: RankContext, st: RestoreState, timeout_s: float = 10.0) -> None:
    """Kill every process of the task cgroup and wait until it is empty (what a restore left running)."""
    st.pid = None
    try:
        ctx.cgroup.kill_all()
    except OSError as e:
        log.warning("killing the restored tree after a failed restore: %s", e)
    deadline = time.monotonic() + timeout_s
    while ctx.cgroup.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    if ctx.cgroup.pids():
        raise RestoreError(f"the restored tree did not die after a failed restore: {ctx.cgroup.pids()}",
                           step=ctx.step, rank=ctx.rank)


RESTORE = Table("restore", (
    Stage("gpu-check", _gpu_check),
    Stage("unpack", _unpack),                      # its staging area goes either way (runner.py)
    Stage("host-copy-ahead", _read_host_copy_ahead),
    Stage("shared-files", _shared_files),
    Stage("output", _output),
    Stage("truncate", _truncate),                  # a replayed batch step stops after `output`
    Stage("shm", _shm),
    Stage("handovers", _handovers),
    Stage("tcp-hold", _tcp_hold, undo=_tcp_unhold),
    Stage("criu", _criu, undo=_end_restored_tree),
    Stage("host-copy", _host_copy_back),
    Stage("tcp-release", _tcp_release),
    Stage("gpu-restore", _gpu_restore),
), running=Phase.RESTORING, reached=Phase.RESTORED)


def files_to_check(files: Files) -> tuple[list[dict[str, Any]], list[WrittenFile]]:
    """The files mapped shared with another rank, and the files the tree writes, that the restore must find
    as they were at the capture: those /dev/shm files whose saved bytes it writes back are left out. Their
    content now does not matter, and on this node another rank's restore may be writing them back at this
    very moment (a size of 0 B mid-write is no change made outside the job)."""
    rewritten = files.shm_names()
    return ([e for e in files.shared if e["path"] not in rewritten],
            [e for e in files.truncate if e.path not in rewritten])


def _truncate_written_files(entries: list[WrittenFile], creds: Credentials) -> None:
    """Files the tree appends to are cut back to their size at the capture, through an fd opened as the
    job's user (never as root: the path is user-controlled) and only if it is still the inode the tree had
    open. A file that shrank cannot be restored consistently."""
    for e in entries:
        try:
            fd = asuser.open_as_user(creds, e.path, os.O_WRONLY)
        except PermissionDenied as err:
            raise RestoreError(f"cannot prepare files for restore: {err}") from err
        try:
            st = os.fstat(fd)
            if e.ino is not None and st.st_ino != e.ino:
                raise RestoreError(f"{e.path} is not the file the job had open at the checkpoint (replaced "
                                   "or a link to another file)")
            if not stat.S_ISREG(st.st_mode):
                raise RestoreError(f"{e.path} is not a regular file any more")
            if st.st_size < e.size:
                raise RestoreError(f"{e.path} is shorter ({st.st_size} B) than at the checkpoint "
                                   f"({e.size} B); it was modified outside the job")
            if st.st_size > e.size:
                os.ftruncate(fd, e.size)
        finally:
            os.close(fd)
