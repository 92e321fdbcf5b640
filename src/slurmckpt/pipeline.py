"""The checkpoint pipeline of one rank, in order. The coordinator drives the phases across ranks:

    PREPARE   refuse unrestorable state (TCP to other hosts, IPC with other ranks, ipc.py) -> reserve room
              in the store and staging (rank_images.py) -> lock its GPUs -> GPU checkpoint -> freeze the tree
              (cgroup freezer)  ... barrier: all READY ...
    CAPTURE   record fds/files -> criu dump into node-local staging (tree stays frozen) -> output snapshot
              -> (final only) persist: compress staging into the store, rank.json
    then      RESUME (thaw, then persist at bounded priority) -> COMMIT (coordinator's agent, atomic manifest
              rename) | final: COMMIT -> FINISH (kill)
    or        ABORT at any point -> undo what was done, in reverse: previous commit stays the restorable one.

GPU work comes before the freeze because the CUDA driver's checkpoint calls hang on a frozen or stopped
process (measured on the H200). Restore is the same list read backwards: unpack the images into staging,
verified (and files mapped shared with other ranks) -> output snapshot -> truncate written files -> criu restore (into the freezer
cgroup; loopback TCP to other ranks held until both ends are back) -> GPU restore + unlock.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmckpt import asuser, crossnode, ghost, ipc, netlock, pmi, procfs, proctree, rank_images
from slurmckpt.criu import CheckpointEngine, InheritedFd
from slurmckpt.errors import CaptureError, PermissionDenied, RestoreError, SlurmckptError
from slurmckpt.footprint import Footprint, measure as measure_footprint
from slurmckpt.gpu import GpuStage
from slurmckpt.identity import TreeName
from slurmckpt.launch import Credentials
from slurmckpt.rank_images import StorePolicy
from slurmckpt.storage import JobStore
from slurmckpt.task_cgroup import TaskCgroup

log = logging.getLogger("slurmckpt.pipeline")


@dataclass
class Stage:
    name: str
    run: Callable[["RankPipeline", int], None]
    undo: Callable[["RankPipeline", int], None] | None = None
    discards: bool = False      # its undo drops the epoch's images: skipped when a thaw keeps them


@dataclass
class RankPipeline:
    store: JobStore
    step: str
    rank: int
    cgroup: TaskCgroup                                     # the tree's (task_cgroup.py)
    engine: CheckpointEngine
    gpu: GpuStage
    creds: Credentials
    wrapper_pid: int = 0
    root_pid: int | None = None
    gpu_record: dict | None = None
    tcp_peers: list = field(default_factory=list)        # (local, remote, peer step, peer rank), PREPARE
    shared_files: list = field(default_factory=list)     # files mapped shared with other ranks, PREPARE
    final: bool = False
    replay: bool = False       # batch step with srun running: replayed on restore, so never frozen
    done: list[Stage] = field(default_factory=list)       # stages of the current epoch, for rollback
    record: dict = field(default_factory=dict)            # what this epoch captured (-> rank.json)
    failed_stage: str = ""                                 # the stage that raised last (fresh_start.py)
    timings: dict[str, float] = field(default_factory=dict)
    stall_after: tuple[str, float] | None = None           # Config.debug_stall_after (tests only)
    peer_alive: Callable[[], bool] | None = None           # the wrapper is still the process wrapper_pid names
    ghost_limit_max: int = 256 << 20                       # Config.ghost_limit_max (ghost.py)
    ghost_limit: int = 0                                   # criu --ghost-limit for this epoch's dump (record)
    # IP addresses of the job's other nodes (agent.py asks Slurm): TCP to them is the job's own
    job_addresses: Callable[[], set[str]] = field(default=lambda: set())
    pmi_fd: int = -1           # this start's PMI socket to slurmstepd (srun --mpi=pmi2; pmi.py), else -1
    pmi_ino: int = 0
    footprint: Footprint | None = None                     # this epoch's sizes (SIZE phase, footprint.py)
    policy: StorePolicy | None = None      # staging, compression, persist priority, quotas (rank_images.py)

    def __post_init__(self) -> None:
        if self.policy is None:
            self.policy = StorePolicy.beside(self.store)

    # ---- phases driven by the coordinator ---------------------------------------------------------------
    def size(self, epoch: int) -> dict:
        """SIZE, before anything is locked: what this rank's capture will take (host memory, GPU memory per
        process, room in host memory and the store); refuses a capture that cannot fit, naming why."""
        self._require_tree()
        self.footprint = None
        try:
            measured = measure_footprint(self.cgroup.pids(), self.gpu, self.store.job_dir)
            why = measured.refusals()
            if why:
                raise CaptureError("capture refused before anything was locked: " + "; ".join(why),
                                   step=self.step, rank=self.rank)
        except SlurmckptError:
            self.failed_stage = "size"
            raise
        self.footprint = measured
        return {**measured.reply(), "notes": list(measured.gpu.notes)}

    def prepare(self, epoch: int) -> dict:
        self._require_tree()
        self.done, self.record, self.timings, self.gpu_record = [], {}, {}, None
        self.tcp_peers, self.shared_files = [], []
        self.replay = self.step == "batch" and proctree.has_slurm_client(self.cgroup.pids())
        self._run(PREPARE_STAGES, epoch)
        return {"timings": self.timings}

    def capture(self, epoch: int, final: bool = True) -> dict:
        """A final capture persists to the store while frozen (the tree dies next). A periodic one persists
        in resume(), after the thaw: compressing and copying GiBs must not stretch the freeze."""
        if not self.done or self.done[-1] is not PREPARE_STAGES[-1]:
            raise CaptureError("CAPTURE before PREPARE completed", epoch=epoch)
        self.final = final
        self._run(CAPTURE_STAGES if final else CAPTURE_STAGES[:-1], epoch)
        return {"kind": self.record["kind"], "bytes": self.record.get("bytes", 0), "timings": self.timings}

    def resume(self, epoch: int) -> dict:
        """After a periodic capture of every rank: the tree runs on, then its staged images are persisted
        to the store at bounded priority (COMMIT needs every rank's). A persist failure leaves the epoch
        uncommitted and staging clean; the tree keeps running."""
        persisted = self.done and self.done[-1] is CAPTURE_STAGES[-1]
        dumped = any(stage is CAPTURE_STAGES[1] for stage in self.done)
        self._rollback(epoch, keep_images=True)
        if dumped and not persisted:
            rank_images.persist(self, epoch, background=True)
        return {"bytes": self.record.get("bytes", 0), "raw_bytes": self.record.get("raw_bytes", 0)}

    def abort(self, epoch: int) -> None:
        """Undo this epoch; after the thaw (its persist done, the epoch failed elsewhere) its images go."""
        resumed = not self.done
        self._rollback(epoch, keep_images=False)
        if resumed:
            rank_images.discard(self, epoch)

    def finish(self, epoch: int) -> None:
        """After COMMIT of a final capture: the tree dies (killed while frozen, so it runs no further).
        Every process of the cgroup, not only the root: a GPU task runs in the host PID namespace, where the
        init's death does not take the tree with it."""
        self.cgroup.kill_all()
        self.done = []

    # ---- internals -------------------------------------------------------------------------------------
    def _require_tree(self) -> None:
        if not self.root_pid or not procfs.exists(self.root_pid):
            raise CaptureError("no running task tree to capture", step=self.step, rank=self.rank)

    def _run(self, stages: tuple[Stage, ...], epoch: int) -> None:
        for stage in stages:
            start = time.monotonic()
            try:
                stage.run(self, epoch)
            except SlurmckptError:
                self.failed_stage = stage.name
                self.abort(epoch)
                raise
            except Exception as e:  # an unexpected failure still rolls back
                self.failed_stage = stage.name
                self.abort(epoch)
                raise CaptureError(f"stage {stage.name} failed: {e}", epoch=epoch) from e
            self.timings[stage.name] = round(time.monotonic() - start, 4)
            self.done.append(stage)
            if self.stall_after and self.stall_after[0] == stage.name:
                log.warning("debug_stall_after: pausing %.1fs after %s of epoch %d", self.stall_after[1],
                            stage.name, epoch)
                time.sleep(self.stall_after[1])

    def _rollback(self, epoch: int, keep_images: bool) -> None:
        errors = []
        for stage in reversed(self.done):
            if stage.undo is None or (keep_images and stage.discards):
                continue
            try:
                stage.undo(self, epoch)
            except Exception as e:  # keep undoing: a tree left frozen is worse than a logged error
                errors.append(f"{stage.name}: {e}")
        self.done = []
        if errors:
            raise CaptureError("rollback incomplete: " + "; ".join(errors), epoch=epoch)


# ---- capture stages ------------------------------------------------------------------------------------
def _freeze(p: RankPipeline, epoch: int) -> None:
    if not p.replay:     # srun must keep relaying what the (frozen) steps already wrote to the output
        p.timings["freeze_wait"] = p.cgroup.freeze()


def _thaw(p: RankPipeline, epoch: int) -> None:
    p.cgroup.thaw()


def _check_restorable(p: RankPipeline, epoch: int) -> None:
    """Refuse, before anything is frozen, what could not be restored (named, so users can act on it)."""
    pids = p.cgroup.pids()
    if p.replay:     # replayed, not imaged: srun's own connections to the step daemons are expected
        _refuse_replayed_batch_talking_to_other_nodes(p, pids)
        return
    # Each rank is dumped and restored by its own criu run: what it shares with another tree is refused
    # where that cannot come back consistently (ipc.py says which and why).
    stdio = {t.link for t in (proctree.fd_target(p.root_pid, fd) for fd in (0, 1, 2)) if t}
    if p.pmi_fd >= 0:       # dumped as external and replaced by the new step's at the restore (pmi.py)
        stdio.add(f"socket:[{p.pmi_ino}]")
    trees = ipc.job_trees(p.cgroup.other_trees(), p.cgroup.tree.job)   # the job's own, never another job's
    # TCP whose other end the job holds on this node (the tree itself or another rank) is inside the job;
    # to another node of the job it is too (both ends frozen at the barrier, restored on the same nodes:
    # crossnode.py); to anything else (a client, a database) it is dumped and restored closed (_record).
    outside = proctree.outside_tcp(pids, inside=proctree.socket_inodes(list(trees)))
    other_nodes = p.job_addresses() if outside else set()
    closed = [str(c) for c in outside if c.remote_ip not in other_nodes]
    if closed:
        log.info("capturing with connection(s) to outside the job, restored closed: %s", ", ".join(closed))
    shared = ipc.unshareable(pids, {pid: name.label for pid, name in trees.items()}, stdio)
    if shared:
        raise CaptureError("state shared outside this rank's process tree cannot be restored: "
                           + "; ".join(shared), step=p.step, rank=p.rank)
    # Deleted files the tree still uses: refused here, before the freeze, when above the cap; sized again
    # once frozen (_record), since the tree runs on until then.
    ghost.limit_for(proctree.deleted_files(pids), p.ghost_limit_max, step=p.step, rank=p.rank)
    # What this rank shares with other ranks of the job, seen while every rank still runs (a final capture's
    # dump ends the tree it dumped): TCP on this node, held at restore until both ends are back (netlock.py);
    # files mapped shared, fingerprinted at the capture and compared before the restore (ipc.py).
    peers = {pid: (name.step, name.rank) for pid, name in trees.items()}
    p.tcp_peers = netlock.internal_connections(pids, peers)
    _refuse_replayed_peers(p, trees)
    p.shared_files = ipc.shared_files(pids, set(peers))


def _refuse_replayed_peers(p: RankPipeline, trees: dict[int, TreeName]) -> None:
    """TCP to a batch step that runs srun: such a batch step is replayed on requeue (its script runs again
    from the top), not restored, so its end of the connection would start afresh while this one is restored.
    That is OpenMPI's mpirun starting its daemons (orted) through srun (docs/mpi.md)."""
    to_batch = [f"{c[0]} -> {c[1]}" for c in p.tcp_peers if c[2] == "batch"]
    if not to_batch:
        return
    batch = [pid for pid, name in trees.items() if name.step == "batch"]
    if proctree.has_slurm_client(batch):
        raise CaptureError(f"TCP connection(s) {', '.join(to_batch)} to the batch step, which is running srun: "
                           "a batch step running srun is replayed on requeue, not restored, so its end would "
                           "start again while this one is restored (OpenMPI's mpirun starting orted through "
                           "srun does this); on one node let mpirun start the ranks itself (`--mca plm ^slurm "
                           "--mca ras ^slurm`) (docs/mpi.md)",
                           step=p.step, rank=p.rank)


def _refuse_replayed_batch_talking_to_other_nodes(p: RankPipeline, pids: list[int]) -> None:
    """The batch step runs srun, so it is replayed on requeue (its script runs again from the top) while
    the steps' ranks are restored: a process of it (other than srun itself) with TCP to another node of the
    job talks to a rank there, which would be restored while this end starts afresh. That is OpenMPI's
    mpirun starting orted on the other nodes through srun (docs/mpi.md)."""
    mine = [pid for pid in pids if proctree.exe_name(pid) not in ("srun", "sattach")]
    outside = proctree.outside_tcp(mine)
    nodes = p.job_addresses() if outside else set()
    to_nodes = [str(c) for c in outside if c.remote_ip in nodes]
    if to_nodes:
        raise CaptureError(f"TCP connection(s) {', '.join(to_nodes)} from the batch step, which is running srun, "
                           "to ranks on other nodes of the job: a batch step running srun is replayed on "
                           "requeue, not restored, so its end would start again while the other is restored "
                           "(OpenMPI's mpirun starting orted through srun does this) (docs/mpi.md)",
                           step=p.step, rank=p.rank)


def _gpu_lock(p: RankPipeline, epoch: int) -> None:
    p.gpu.lock(p.cgroup.pids())     # refuses unsupported GPU set-ups before anything is frozen


def _gpu_unlock(p: RankPipeline, epoch: int) -> None:
    p.gpu.unlock()


def _record(p: RankPipeline, epoch: int) -> None:
    pids = p.cgroup.pids()
    ghosts = [] if p.replay else proctree.deleted_files(pids)
    p.ghost_limit = ghost.limit_for(ghosts, p.ghost_limit_max, step=p.step, rank=p.rank)
    stdio = [t for t in (proctree.fd_target(p.root_pid, fd) for fd in (0, 1, 2)) if t]
    outputs = {t.link for t in stdio if t.regular}
    replay = p.replay
    p.record = {
        "kind": "replay" if replay else "image",
        "stdio": [{"fd": t.fd, "link": t.link, "key": t.criu_key, "regular": t.regular, "size": t.size}
                  for t in stdio],
        "truncate": [] if replay else [{"path": k, "size": t.size, "ino": t.ino}
                                       for k, t in proctree.written_files(pids, outputs).items()],
        # The batch shell reads its script from the node's spool (<SlurmdSpoolDir>/jobNNNNN/slurm_script),
        # which is elsewhere on another node: restored from the new start's script fd (same content).
        "batch_script": [] if replay or p.step != "batch" else _batch_script_fds(pids, p.store.job),
        "processes": len(pids), "node": socket.gethostname(), "uid": p.creds.uid,
        "gpu": p.gpu_record,
        # loopback TCP to other ranks of the job: held (netlock) while only one end is restored
        "tcp_ranks": [] if replay else netlock.still_established(pids, p.tcp_peers),
        "shared_files": [] if replay else ipc.fingerprint_files(pids, p.shared_files),
        "ghost_files": [{"path": f.path, "size": f.size, "how": f.how} for f in ghosts],
        "pmi": [] if replay else _pmi_socket(p, pids),
        **({} if replay else _tcp_leaving_the_node(p, pids)),
    }
    rank_images.staged(p, epoch)


def _tcp_leaving_the_node(p: RankPipeline, pids: list[int]) -> dict:
    """TCP whose other end is not on this node: to another node of the job (restored as dumped, held until
    both ends are back: crossnode.py), or to outside the job (its other end goes on without the job, so it
    is restored closed)."""
    others = proctree.socket_inodes(list(ipc.job_trees(p.cgroup.other_trees(), p.store.job)))
    outside = proctree.outside_tcp(pids, inside=others)
    nodes = p.job_addresses() if outside else set()
    return {"tcp_nodes": crossnode.job_connections(outside, nodes),
            "tcp_close": [c.inode for c in outside if c.remote_ip not in nodes]}


SCRIPT_RE = re.compile(r"/job(\d+)/slurm_script$")


def _batch_script_fds(pids: list[int], job: int) -> list[dict]:
    """The tree's fds on this job's spooled batch script: criu key and file position (bash reads its
    script through such an fd as it goes; the restored one must continue where it was)."""
    found: dict[str, int] = {}
    for pid in pids:
        for t in proctree.open_files(pid):
            m = SCRIPT_RE.search(t.link)
            if m and int(m.group(1)) == job and t.criu_key not in found:
                found[t.criu_key] = proctree.fd_position(pid, t.fd)
    return [{"key": k, "pos": pos} for k, pos in sorted(found.items())]


def _pmi_socket(p: RankPipeline, pids: list[int]) -> list[dict]:
    """The task's PMI socket to slurmstepd, if the tree holds it: criu key; idle, or the capture is refused
    (bytes in flight would be lost with the old slurmstepd)."""
    key = f"socket:[{p.pmi_ino}]"
    if p.pmi_fd < 0 or not any(t.link == key for pid in pids for t in proctree.open_files(pid)):
        return []
    pmi.require_idle(p.pmi_fd, p.step, p.rank)
    return [{"key": key, "ino": p.pmi_ino}]


def _gpu_checkpoint(p: RankPipeline, epoch: int) -> None:
    p.gpu_record = p.gpu.checkpoint()


def _gpu_restore_after_capture(p: RankPipeline, epoch: int) -> None:
    p.gpu.resume()


def _dump(p: RankPipeline, epoch: int) -> None:
    if p.record["kind"] == "image":
        rdir = rank_images.area(p, epoch)
        # A final capture lets criu end the tree itself: it closes TCP sockets in repair mode, so no FIN and
        # no TIME_WAIT holds the ports the restore must bind again (a plain kill after the dump would).
        p.timings["criu_dump"] = p.engine.dump(p.root_pid, rdir, leave_running=not p.final,
                                               freezer=p.cgroup.path, ghost_limit=p.ghost_limit,
                                               external=[f"unix[{e['ino']}]" for e in p.record["pmi"]])
        if not p.final and p.cgroup.state() != "FROZEN":   # consistency depends on the tree staying frozen
            raise CaptureError("tree was thawed by the dump", epoch=epoch)


def _discard_images(p: RankPipeline, epoch: int) -> None:
    rank_images.discard(p, epoch)


def _snapshot_output(p: RankPipeline, epoch: int) -> None:
    """Copy the task's output files (the wrapper's stdout/stderr when Slurm gave it regular files) up to
    their size at the freeze: Slurm truncates the output file on requeue (without --open-mode=append) and
    restore rewrites it to exactly this content, so the job's output holds everything exactly once.
    The wrapper is the user's: its fds are read as the user (asuser.py), never through /proc as root."""
    rdir = rank_images.area(p, epoch)
    if p.replay:
        _wait_output_settled(p.wrapper_pid)
    outputs, seen = [], {}
    for fd in (1, 2):
        t = proctree.fd_target(p.wrapper_pid, fd)
        if t is None or not t.regular:
            continue
        if t.path_only:
            raise CaptureError(f"the task's fd {fd} is an O_PATH descriptor ({t.link}): its output cannot be "
                               "kept across a restore", step=p.step, rank=p.rank)
        if t.link not in seen:
            seen[t.link] = f"output-{fd}.snap"
            # Reopened through the wrapper's fd link, as the user: the kernel checks the user's read permission
            # on the file itself (an O_PATH or write-only fd to a file the user cannot read gives nothing).
            src = asuser.open_expected(p.creds, str(procfs.path(p.wrapper_pid, "fd", fd)), os.O_RDONLY, t.dev, t.ino,
                                       f"the task's fd {fd} ({t.link}),")
            try:
                _copy_prefix(src, rdir / seen[t.link], t.size, t.link)
            finally:
                os.close(src)
        outputs.append({"fd": fd, "link": t.link, "size": t.size, "snapshot": seen[t.link]})
    if p.peer_alive and not p.peer_alive():
        raise CaptureError("the task's wrapper exited during the capture", step=p.step, rank=p.rank)
    p.record["outputs"] = outputs


def _wait_output_settled(wrapper_pid: int, quiet_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Every step rank is frozen by now; what they wrote before still travels through slurmstepd and srun
    to the batch output file. Wait until the file stops growing, so the snapshot holds all of it."""
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


def _copy_prefix(src: int, dst: Path, size: int, name: str) -> None:
    with os.fdopen(os.dup(src), "rb") as fin, open(dst, "wb") as fout:
        remaining = size
        while remaining:
            block = fin.read(min(remaining, 8 << 20))
            if not block:
                raise CaptureError(f"output file shrank during capture ({name})")
            fout.write(block)
            remaining -= len(block)


def _persist_final(p: RankPipeline, epoch: int) -> None:
    rank_images.persist(p, epoch, background=False)      # the tree is gone: full speed


PREPARE_STAGES = (
    Stage("check", _check_restorable),
    Stage("space", rank_images.reserve, undo=rank_images.release, discards=True),
    Stage("gpu-lock", _gpu_lock, undo=_gpu_unlock),
    Stage("gpu-checkpoint", _gpu_checkpoint, undo=_gpu_restore_after_capture),
    Stage("freeze", _freeze, undo=_thaw),
)
CAPTURE_STAGES = (
    Stage("record", _record, undo=_discard_images, discards=True),
    Stage("dump", _dump),           # a replayed batch step is not dumped (see _record)
    Stage("snapshot-output", _snapshot_output),
    Stage("persist", _persist_final),     # periodic captures persist in resume(), after the thaw
)


# ---- restore ------------------------------------------------------------------------------------------
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
    ipc.check_shared_files(manifest.get("shared_files", []), key, p.creds.uid)
    _rewrite_outputs(manifest, rdir, stdio)
    if manifest["kind"] == "replay":
        return None, manifest
    _truncate_written_files(manifest["truncate"], p.creds)
    inherit, seen = [], set()
    for entry in manifest["stdio"]:
        if entry["key"] in seen or not (entry["regular"] or entry["link"].startswith(("pipe:", "socket:"))):
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
    if manifest.get("pmi"):
        pmi.reinit(p.pmi_fd)        # slurmstepd takes a task's first PMI line as its init
    held = netlock.confirmed(manifest.get("tcp_ranks", []), p.step, p.rank,
                             lambda step, rank: p.store.read_rank_manifest(epoch, step, rank))
    between_nodes = manifest.get("tcp_nodes", [])
    if between_nodes:
        crossnode.require_local_addresses(between_nodes, proctree.local_addresses(), manifest.get("node", "?"))
    hold = crossnode.Hold(between_nodes, p.store.job_dir / ".tcp-sync", f"{p.cgroup.tree.restart}.{epoch}",
                          f"slurmckpt job {p.store.job}")
    try:
        hold.before_restore()
        with netlock.hold_during_restore(held, key, f"slurmckpt job {p.store.job}"):
            pid = p.engine.restore(rdir, inherit, freezer=p.cgroup.path, pidfile=rdir / "restore.pid",
                                   join=p.cgroup.add, tcp_close=manifest.get("tcp_close", []))
    except BaseException:
        hold.release()
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


def _rewrite_outputs(manifest: dict, rdir: Path, stdio: list[int]) -> None:
    done = set()
    for entry in manifest.get("outputs", []):
        if entry["snapshot"] in done:
            continue
        fd = stdio[entry["fd"]]
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RestoreError(f"the task's fd {entry['fd']} is not a regular file now (it was "
                               f"{entry['link']} at the capture): cannot restore its output")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        with open(rdir / entry["snapshot"], "rb") as f:
            while block := f.read(8 << 20):
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
        done.add(entry["snapshot"])


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
