"""The checkpoint pipeline of one rank, in order. The coordinator drives the phases across ranks:

    SIZE      (GPU jobs) host and GPU bytes, refused up front when they cannot fit (rank/fit.py)
    PREPARE   refuse unrestorable state (rank/checks.py) -> no PMI exchange under way (cheap early look)
              -> reserve room in the store and staging
              (rank/images.py) -> lock its GPUs -> GPU checkpoint -> freeze the tree (cgroup freezer)
              -> no PMI exchange under way (else thaw and retry the round, pmi.py)
              -> the tree's stdio pipes read empty by slurmstepd (output_pipes.py)
              ... barrier: all READY ...
    CAPTURE   record fds/files -> criu dump into node-local staging (tree stays frozen) -> output snapshot
              -> (final only) persist: compress staging into the store, rank.json
    then      RESUME (thaw, then persist at bounded priority) -> COMMIT (coordinator's agent, atomic manifest
              rename) | final: COMMIT -> FINISH (kill)
    or        ABORT at any point -> undo what was done, in reverse: previous commit stays the restorable one.

GPU work comes before the freeze because the CUDA driver's checkpoint calls hang on a frozen or stopped
process (measured on the H200). Restore is the same list read backwards: restore.py.
"""
from __future__ import annotations

import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from slurmckpt.rank import checks as capture_checks
from slurmckpt.rank import ghost
from slurmckpt.rank.sharing import ipc
from slurmckpt.rank.sharing import netlock
from slurmckpt.rank import output_pipes
from slurmckpt.rank import output_snapshot
from slurmckpt.slurm import pmi
from slurmckpt.node import procfs
from slurmckpt.rank import images as rank_images
from slurmckpt.rank.sharing import shm_files
from slurmckpt.node import tcp_ports
from slurmckpt.store import space
from slurmckpt.node import proctree
from slurmckpt.criu.driver import CheckpointEngine
from slurmckpt.cuda.procscan import inherited_device_majors
from slurmckpt.errors import CaptureError, CriuInterrupted, SlurmckptError, TaskEnded
from slurmckpt.rank.fit import Footprint, measure as measure_footprint
from slurmckpt.cuda.interface import GpuStage
from slurmckpt.node.launch import Credentials
from slurmckpt.node.packet_filter import Iptables, PacketFilter
from slurmckpt.rank.images import StorePolicy
from slurmckpt.store.jobstore import JobStore
from slurmckpt.node.task_cgroup import TaskCgroup

log = logging.getLogger("slurmckpt.rank.pipeline")


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
    tcp_outside: dict = field(default_factory=dict)      # socket inode -> to another node of the job?, PREPARE
    final: bool = False
    replay: bool = False       # batch step with srun running: replayed on restore, so never frozen
    done: list[Stage] = field(default_factory=list)       # stages of the current epoch, for rollback
    record: dict = field(default_factory=dict)            # what this epoch captured (-> rank.json)
    failed_stage: str = ""                                 # the stage that raised last (fresh_start.py)
    timings: dict[str, float] = field(default_factory=dict)
    stall_after: tuple[str, float] | None = None           # Config.debug_stall_after (tests only)
    peer_alive: Callable[[], bool] | None = None           # the wrapper is still the process wrapper_pid names
    ghost_limit_max: int = 256 << 20                       # Config.ghost_limit_max (ghost.py)
    killed_for: str = ""                                   # why this agent killed the tree (kill_tree)
    ghost_limit: int = 0                                   # criu --ghost-limit for this epoch's dump (record)
    # IP addresses of the job's other nodes (agent.py asks Slurm): TCP to them is the job's own
    job_addresses: Callable[[], set[str]] = field(default=lambda: set())
    pmi_fd: int = -1           # this start's PMI socket to slurmstepd (srun --mpi=pmi2; pmi.py), else -1
    pmi_ino: int = 0
    # sockets of srun stand-ins to the batch wrapper (srun_relay.py): dumped as external, replaced at a
    # restore by `standin_fds` (new sockets whose other ends the new wrapper holds)
    standin_inos: set[int] = field(default_factory=set)
    standin_fds: list[int] = field(default_factory=list)
    step_token: str = ""       # a relayed srun's step: its name across restores (agent.py, plan)
    footprint: Footprint | None = None                     # this epoch's sizes (SIZE phase, rank/fit.py)
    policy: StorePolicy | None = None      # staging, compression, persist priority, quotas (rank/images.py)
    # holds TCP between ranks while one end is restored (netlock.py, crossnode.py): iptables or nftables
    packets: PacketFilter = field(default_factory=Iptables)
    # bytes this epoch may copy from the user's files (PREPARE's count, rank_images.reserve; space.py)
    copy_budget: space.CopyBudget = field(default_factory=lambda: space.CopyBudget(0))

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
        self.tcp_peers, self.shared_files, self.tcp_outside = [], [], {}
        self.copy_budget = space.CopyBudget(0)
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
        Every process of the cgroup, not only the root: one that left the tree's PID namespace (a
        setns'd helper) does not die with its init."""
        self.cgroup.kill_all()
        self.done = []

    # ---- internals -------------------------------------------------------------------------------------
    def _require_tree(self) -> None:
        if self.killed_for:
            raise CaptureError(f"nothing to capture: the task's tree was killed ({self.killed_for})",
                               step=self.step, rank=self.rank)
        if not self.root_pid or not procfs.exists(self.root_pid):
            raise TaskEnded("no running task tree to capture", step=self.step, rank=self.rank)

    def _run(self, stages: tuple[Stage, ...], epoch: int) -> None:
        for stage in stages:
            start = time.monotonic()
            try:
                stage.run(self, epoch)
            except SlurmckptError as e:
                self.failed_stage = stage.name
                self._abort_after(e, stage.name, epoch)
                raise
            except Exception as e:  # an unexpected failure still rolls back
                self.failed_stage = stage.name
                self._abort_after(e, stage.name, epoch)
                raise CaptureError(f"stage {stage.name} failed: {e}", epoch=epoch) from e
            self.timings[stage.name] = round(time.monotonic() - start, 4)
            self.done.append(stage)
            if self.stall_after and self.stall_after[0] == stage.name:
                log.warning("debug_stall_after: pausing %.1fs after %s of epoch %d", self.stall_after[1],
                            stage.name, epoch)
                time.sleep(self.stall_after[1])

    def _abort_after(self, failure: BaseException, stage: str, epoch: int) -> None:
        """Undo the epoch after `stage` failed; if undoing fails too, the error names both (the first
        failure is what the user and admin need to see)."""
        try:
            self.abort(epoch)
        except CaptureError as undo:
            raise CaptureError(f"stage {stage} failed: {failure}; then {undo}", epoch=epoch) from failure

    def _rollback(self, epoch: int, keep_images: bool) -> None:
        errors, gpu_lost = [], False
        for stage in reversed(self.done):
            if stage.undo is None or (keep_images and stage.discards):
                continue
            try:
                stage.undo(self, epoch)
            except Exception as e:  # keep undoing: a tree left frozen is worse than a logged error
                errors.append(f"{stage.name}: {e}")
                gpu_lost = gpu_lost or bool(getattr(e, "stuck", None))    # cuda.stage.GpuRollbackError
        self.done = []
        if gpu_lost and not self.killed_for:
            errors.append(self.kill_tree(f"a process lost its GPU state in epoch {epoch}",
                                         "it cannot run on without its GPU state"))
        if errors:
            raise CaptureError("rollback incomplete: " + "; ".join(errors), epoch=epoch)

    def kill_tree(self, why: str, consequence: str) -> str:
        """The tree must not run on (a process the GPU rollback could not bring back has lost its GPU state;
        criu was interrupted and may have left its parasite in it): it is killed, still frozen where it was
        (the wrapper then leaves the job without an exit code, so no capture commits without this rank) and
        never captured again; the previous commit stays the one restored. Returns what to tell the user."""
        self.killed_for = why
        log.error("killing the task's tree: %s", why, extra={"step": self.step, "rank": self.rank})
        try:
            self.cgroup.kill_all()
        except OSError as e:     # still never captured again: killed_for is set
            log.error("killing the task's tree failed: %s", e, extra={"step": self.step, "rank": self.rank})
            return (f"killing the task failed ({e.strerror or e}): {consequence} and is never captured again; "
                    "cancel the job (scancel); the previous checkpoint stays the one restored (scontrol "
                    "requeue restores it)")
        return (f"the task was killed: {consequence}; the previous checkpoint stays the one restored "
                "(scontrol requeue restores it)")


# ---- capture stages ------------------------------------------------------------------------------------
def _freeze(p: RankPipeline, epoch: int) -> None:
    if not p.replay:     # srun must keep relaying what the (frozen) steps already wrote to the output
        p.timings["freeze_wait"] = p.cgroup.freeze()


def _thaw(p: RankPipeline, epoch: int) -> None:
    p.cgroup.thaw()


def _gpu_lock(p: RankPipeline, epoch: int) -> None:
    p.gpu.lock(p.cgroup.pids())     # refuses unsupported GPU set-ups before anything is frozen


def _gpu_unlock(p: RankPipeline, epoch: int) -> None:
    p.gpu.unlock()


def _record(p: RankPipeline, epoch: int) -> None:
    pids = p.cgroup.pids()
    ghosts = [] if p.replay else proctree.deleted_files(pids)
    p.ghost_limit = ghost.limit_for(ghosts, p.ghost_limit_max, step=p.step, rank=p.rank)
    shm = [] if p.replay else shm_files.held(pids, p.creds.uid)
    stdio = [t for t in (proctree.fd_target(p.root_pid, fd) for fd in (0, 1, 2)) if t]
    outputs = {t.link for t in stdio if t.regular}
    replay = p.replay
    view = proctree.MountView() if replay else proctree.mount_view(p.root_pid)
    script = [] if replay or p.step != "batch" else _batch_script_fds(pids, p.store.job, view)
    p.record = {
        "kind": "replay" if replay else "image",
        "stdio": [{"fd": t.fd, "link": t.link, "key": view.key(t), "regular": t.regular, "size": t.size}
                  for t in stdio],
        # a GPU tree's own mount namespace: what it holds through the node's mounts is handed in again
        "mntns": view.inside is not None,
        "external_files": sorted({k for k in [view.key(t) for t in stdio] + [e["key"] for e in script]
                                  if k.startswith("file[")}),
        "truncate": [] if replay else [{"path": k, "size": t.size, "ino": t.ino}
                                       for k, t in proctree.written_files(pids, outputs).items()],
        # The batch shell reads its script from the node's spool (<SlurmdSpoolDir>/jobNNNNN/slurm_script),
        # which is elsewhere on another node: restored from the new start's script fd (same content).
        "batch_script": script,
        "processes": len(pids), "node": socket.gethostname(), "uid": p.creds.uid,
        "gpu": p.gpu_record,
        # loopback TCP to other ranks of the job: held (netlock) while only one end is restored
        "tcp_ranks": [] if replay else netlock.still_established(pids, p.tcp_peers),
        "shared_files": [] if replay else ipc.fingerprint_files(pids, p.shared_files),
        "ghost_files": [{"path": f.path, "size": f.size, "how": f.how} for f in ghosts],
        "shm_files": shm_files.save(p.creds, shm, rank_images.staged(p, epoch), p.copy_budget.charge),
        "pmi": [] if replay else _pmi_socket(p, pids),
        "srun_standins": [] if replay else _standin_sockets(p, pids),
        "tcp_ports": {} if replay else tcp_ports.record(pids),     # their own TIME_WAIT gone before a restore
        **({"step_token": p.step_token} if p.step_token else {}),
        **({} if replay else capture_checks.tcp_leaving_the_node(p, pids)),
    }
    rank_images.staged(p, epoch)


SCRIPT_RE = re.compile(r"/job(\d+)/slurm_script$")


def _batch_script_fds(pids: list[int], job: int, view: proctree.MountView) -> list[dict]:
    """The tree's fds on this job's spooled batch script: criu key and file position (bash reads its
    script through such an fd as it goes; the restored one must continue where it was)."""
    found: dict[str, int] = {}
    for pid in pids:
        for t in proctree.open_files(pid):
            m = SCRIPT_RE.search(t.link)
            if m and int(m.group(1)) == job and view.key(t) not in found:
                found[view.key(t)] = proctree.fd_position(pid, t.fd)
    return [{"key": k, "pos": pos} for k, pos in sorted(found.items())]


def _pmi_socket(p: RankPipeline, pids: list[int]) -> list[dict]:
    """The task's PMI socket to slurmstepd, if the tree holds it: criu key (idle: checked in PREPARE, and
    the tree has stayed frozen since)."""
    key = f"socket:[{p.pmi_ino}]"
    if p.pmi_fd < 0 or not any(t.link == key for pid in pids for t in proctree.open_files(pid)):
        return []
    return [{"key": key, "ino": p.pmi_ino}]


def _standin_sockets(p: RankPipeline, pids: list[int]) -> list[dict]:
    """The srun stand-ins' sockets to the wrapper that the tree still holds, in a fixed order (the restore
    hands in one new socket for each)."""
    held = {t.link for pid in pids for t in proctree.open_files(pid)}
    return [{"key": f"socket:[{ino}]", "ino": ino} for ino in sorted(p.standin_inos)
            if f"socket:[{ino}]" in held]


def _pmi_between_exchanges(p: RankPipeline, epoch: int) -> None:
    """After the freeze: no PMI exchange under way, or the round is tried again (pmi.require_no_exchange).
    A replayed batch step is not frozen and not imaged: nothing to check."""
    if p.pmi_fd >= 0 and not p.replay:
        pmi.require_no_exchange(p.pmi_fd, p.pmi_ino, p.cgroup.pids(), p.step, p.rank)


def _drain_output(p: RankPipeline, epoch: int) -> None:
    """After the freeze: what the tree wrote to its stdio pipes has been read by slurmstepd, so the batch
    rank's output snapshot (CAPTURE, after the barrier) can hold it (output_pipes.py)."""
    if not p.replay:
        output_pipes.wait_drained(p.creds, [pid for pid in (p.wrapper_pid, p.root_pid) if pid])


def _gpu_checkpoint(p: RankPipeline, epoch: int) -> None:
    p.gpu_record = p.gpu.checkpoint()


def _gpu_restore_after_capture(p: RankPipeline, epoch: int) -> None:
    p.gpu.resume()


def _dump(p: RankPipeline, epoch: int) -> None:
    if p.record["kind"] == "image":
        rdir = rank_images.area(p, epoch)
        # A final capture lets criu end the tree itself: it closes TCP sockets in repair mode, so no FIN and
        # no TIME_WAIT holds the ports the restore must bind again (a plain kill after the dump would).
        try:
            p.timings["criu_dump"] = p.engine.dump(p.root_pid, rdir, leave_running=not p.final,
                                                   freezer=p.cgroup.path, ghost_limit=p.ghost_limit,
                                                   external=[f"unix[{e['ino']}]" for e in p.record["pmi"]
                                                             + p.record["srun_standins"]]
                                                   + p.record["external_files"],
                                                   link_remap=any(e["removed"] for e in p.record["shm_files"]),
                                                   mntns=p.record["mntns"],
                                                   inherited_devices=inherited_device_majors(p.cgroup.pids()))
        except CriuInterrupted:
            # Stopped at its timeout or killed: a process may still hold criu's parasite code (or half of a
            # cure), which the rollback's thaw would run. Killed first, while frozen (criu.py, STOP_SIGNAL).
            p.kill_tree(f"criu was interrupted in the dump of epoch {epoch}",
                        "criu may have left its parasite code in it")
            raise
        shm_files.note_remaps(p.record["shm_files"], rdir)
        shm_files.remove_links(p.creds, p.record["shm_files"])     # put back by the restore, on any node
        if not p.final and p.cgroup.state() != "FROZEN":   # consistency depends on the tree staying frozen
            raise CaptureError("tree was thawed by the dump", epoch=epoch)


def _discard_images(p: RankPipeline, epoch: int) -> None:
    rank_images.discard(p, epoch)


def _snapshot_output(p: RankPipeline, epoch: int) -> None:
    p.record["outputs"] = output_snapshot.take(p, rank_images.area(p, epoch))


def _persist_final(p: RankPipeline, epoch: int) -> None:
    rank_images.persist(p, epoch, background=False)      # the tree is gone: full speed


PREPARE_STAGES = (
    Stage("check", capture_checks.check_restorable),
    # the same PMI check on the running tree: a rank that sits in a long PMI barrier is sent back before its
    # GPU checkpoint, which each retried round would otherwise repeat (seconds per GiB); the check after the
    # freeze is the one that counts
    Stage("pmi-precheck", _pmi_between_exchanges),
    Stage("space", rank_images.reserve, undo=rank_images.release, discards=True),
    Stage("gpu-lock", _gpu_lock, undo=_gpu_unlock),
    Stage("gpu-checkpoint", _gpu_checkpoint, undo=_gpu_restore_after_capture),
    Stage("freeze", _freeze, undo=_thaw),
    Stage("pmi-idle", _pmi_between_exchanges),
    Stage("drain-output", _drain_output),
)
CAPTURE_STAGES = (
    Stage("record", _record, undo=_discard_images, discards=True),
    Stage("dump", _dump),           # a replayed batch step is not dumped (see _record)
    Stage("snapshot-output", _snapshot_output),
    Stage("persist", _persist_final),     # periodic captures persist in resume(), after the thaw
)
