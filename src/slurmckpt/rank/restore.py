"""Restore of one rank: the capture pipeline read backwards (docs/architecture.md, "Restore on requeue").

    check the target GPUs -> unpack and verify the images into staging (rank/images.py) -> files mapped
    shared with other ranks unchanged (ipc.py) -> output snapshot -> files the tree writes cut back ->
    criu restore into the task cgroup (TCP to other ranks held until both ends are back: netlock.py, to
    other nodes: crossnode.py; connections to outside the job restored closed) -> GPU restore + unlock.

A failure after criu brought the tree back kills it again, so that the wrapper's fallback (an older epoch, a
fresh start) finds the task cgroup empty.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slurmckpt.rank.sharing import crossnode
from slurmckpt.rank.sharing import ipc
from slurmckpt.rank.sharing import netlock
from slurmckpt.rank import output_snapshot
from slurmckpt.slurm import pmi
from slurmckpt.rank import images as rank_images
from slurmckpt.rank.sharing import shm_files
from slurmckpt.node import tcp_ports
from slurmckpt.node import asuser
from slurmckpt.node import proctree
from slurmckpt.criu.driver import InheritedFd
from slurmckpt.errors import CriuInterrupted, PermissionDenied, RestoreError, SlurmckptError
from slurmckpt.node.launch import Credentials

if TYPE_CHECKING:
    from slurmckpt.rank.pipeline import RankPipeline

log = logging.getLogger("slurmckpt.rank.pipeline")


def restore_rank(p: RankPipeline, epoch: int, stdio: list[int]) -> tuple[int | None, dict]:
    """Restore this rank from `epoch` with the new task's stdio fds. Returns (root pid or None for a
    replayed batch step, rank manifest). The target GPUs are checked first (before anything is unpacked or
    touched); the images are unpacked into staging, verified as they are, and the staging area goes once
    criu has read them."""
    p.gpu.check_restore(p.store.read_rank_manifest(epoch, p.step, p.rank).get("gpu"))
    with rank_images.unpacked(p, epoch) as (rdir, manifest):
        return _restore_from(p, epoch, rdir, manifest, stdio)


def _restore_from(p: RankPipeline, epoch: int, rdir: Path, manifest: dict, stdio: list[int]) -> tuple[int | None, dict]:
    key = netlock.restore_key(p.store.job, p.cgroup.tree.restart, epoch)
    shared, truncate = files_to_check(manifest)
    ipc.check_shared_files(shared, key, p.creds, same_node=manifest.get("node") == socket.gethostname())
    output_snapshot.rewrite(manifest, rdir, stdio)
    if manifest["kind"] == "replay":
        return None, manifest
    _truncate_written_files(truncate, p.creds)
    try:
        shm_files.put_back(p.creds, manifest.get("shm_files", []), rdir, key)
    except PermissionDenied as err:
        raise RestoreError(f"cannot prepare /dev/shm for the restore: {err}", step=p.step, rank=p.rank) from err
    inherit, seen = [], set()
    for entry in manifest["stdio"]:
        if entry["key"] in seen or not (entry["regular"] or entry["link"].startswith(("pipe:", "socket:"))
                                        or entry["key"].startswith("file[")):
            continue
        seen.add(entry["key"])
        inherit.append(InheritedFd(entry["key"], stdio[entry["fd"]]))
    if manifest.get("batch_script"):
        if len(stdio) < 4:
            raise RestoreError("the batch script is open in the checkpoint, but this start passed no script fd")
        for entry in manifest["batch_script"]:   # one file, one key: every fd on it shares this position
            os.lseek(stdio[3], entry["pos"], os.SEEK_SET)
            inherit.append(InheritedFd(entry["key"], stdio[3]))
    for entry in manifest.get("pmi", []):
        if p.pmi_fd < 0:
            raise RestoreError("the checkpoint holds a PMI connection to slurmstepd (srun --mpi=pmi2), but "
                               "this start of the task has none (PMI_FD): it was not started by srun --mpi=pmi2")
        inherit.append(InheritedFd(entry["key"], p.pmi_fd))     # the new step's, in the old one's place
    standins = manifest.get("srun_standins", [])
    if len(standins) != len(p.standin_fds):
        raise RestoreError(f"the checkpoint holds {len(standins)} srun stand-in socket(s), this start handed in "
                           f"{len(p.standin_fds)}", step=p.step, rank=p.rank)
    inherit += [InheritedFd(e["key"], fd) for e, fd in zip(standins, p.standin_fds)]  # the new wrapper's
    if manifest.get("pmi"):
        pmi.reinit(p.pmi_fd)        # slurmstepd takes a task's first PMI line as its init
    held = netlock.confirmed(manifest.get("tcp_ranks", []), p.step, p.rank,
                             lambda step, rank: p.store.read_rank_manifest(epoch, step, rank))
    between_nodes = manifest.get("tcp_nodes", [])
    if between_nodes:
        crossnode.require_local_addresses(between_nodes, proctree.local_addresses(), manifest.get("node", "?"))
    hold = crossnode.Hold(between_nodes, p.store.job_dir / ".tcp-sync", f"{p.cgroup.tree.restart}.{epoch}",
                          f"slurmckpt job {p.store.job}", p.packets)
    tcp_ports.free_for(manifest)     # a TIME_WAIT on a listening port fails criu's bind
    try:
        hold.before_restore()
        with netlock.hold_during_restore(held, key, f"slurmckpt job {p.store.job}", p.packets):
            pid = p.engine.restore(rdir, inherit, freezer=p.cgroup.path, pidfile=rdir / "restore.pid",
                                   join=p.cgroup.add, tcp_close=manifest.get("tcp_close", []),
                                   mntns=manifest.get("mntns", False))
    except BaseException as e:
        hold.release()
        _quietly(shm_files.remove_links, p.creds, manifest.get("shm_files", []))
        if isinstance(e, CriuInterrupted):    # criu did not take back what it had restored: none of it runs
            _end_restored_tree(p)
        raise
    hold.after_restore()
    try:
        p.gpu.restore(manifest.get("gpu"), p.cgroup.pids())   # after criu: the tree is back, thawed
    except Exception as e:
        # The restored tree runs (re-parented to the wrapper) but without its GPU state: it must not run
        # on, and the fallback (an older epoch, or a fresh start) needs the task cgroup empty again.
        _end_restored_tree(p)
        if isinstance(e, SlurmckptError):
            raise
        raise RestoreError(f"GPU restore failed: {e}", step=p.step, rank=p.rank) from e
    p.root_pid = pid
    return pid, manifest


def _quietly(action, *args) -> None:
    try:
        action(*args)
    except SlurmckptError as e:
        log.warning("%s", e)


def _end_restored_tree(p: RankPipeline, timeout_s: float = 10.0) -> None:
    """Kill every process of the task cgroup and wait until it is empty (what a restore left running)."""
    p.root_pid = None
    try:
        p.cgroup.kill_all()
    except OSError as e:
        log.warning("killing the restored tree after a failed restore: %s", e)
    deadline = time.monotonic() + timeout_s
    while p.cgroup.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    if p.cgroup.pids():
        raise RestoreError(f"the restored tree did not die after a failed restore: {p.cgroup.pids()}",
                           step=p.step, rank=p.rank)


def files_to_check(manifest: dict) -> tuple[list[dict], list[dict]]:
    """The files mapped shared with another rank, and the files the tree writes, that the restore must find
    as they were at the capture: those /dev/shm files whose saved bytes it writes back are left out. Their
    content now does not matter, and on this node another rank's restore may be writing them back at this
    very moment (a size of 0 B mid-write is no change made outside the job)."""
    rewritten = {e["name"] for e in manifest.get("shm_files", [])}
    return ([e for e in manifest.get("shared_files", []) if e["path"] not in rewritten],
            [e for e in manifest["truncate"] if e["path"] not in rewritten])


def _truncate_written_files(entries: list[dict], creds: Credentials) -> None:
    """Files the tree appends to are cut back to their size at the capture, through an fd opened as the
    job's user (never as root: the path is user-controlled) and only if it is still the inode the tree had
    open. A file that shrank cannot be restored consistently."""
    for e in entries:
        try:
            fd = asuser.open_as_user(creds, e["path"], os.O_WRONLY)
        except PermissionDenied as err:
            raise RestoreError(f"cannot prepare files for restore: {err}") from err
        try:
            st = os.fstat(fd)
            if "ino" in e and st.st_ino != e["ino"]:
                raise RestoreError(f"{e['path']} is not the file the job had open at the checkpoint (replaced "
                                   "or a link to another file)")
            if not stat.S_ISREG(st.st_mode):
                raise RestoreError(f"{e['path']} is not a regular file any more")
            if st.st_size < e["size"]:
                raise RestoreError(f"{e['path']} is shorter ({st.st_size} B) than at the checkpoint "
                                   f"({e['size']} B); it was modified outside the job")
            if st.st_size > e["size"]:
                os.ftruncate(fd, e["size"])
        finally:
            os.close(fd)
