"""One rank's capture as named stage tables (PREPARE, PERIODIC_CAPTURE or FINAL_CAPTURE, RESUME, PERSIST), run
by the engine (engine.py) over the rank's context and the epoch's CaptureState (context.py). The coordinator
drives the phases across ranks:

    SIZE      (GPU jobs) host and GPU bytes, refused up front when they cannot fit (fit.py; runner.py)
    PREPARE   refuse unrestorable state (checks.py) -> no PMI exchange under way (cheap early look)
              -> reserve room in the store and staging (images.py) -> (where the site allows) raise the
              job's memory limits by what the capture adds (host_memory.py) -> lock its GPUs -> GPU checkpoint
              -> freeze the tree (cgroup freezer) -> no PMI exchange under way (else thaw and retry the
              round, slurm/pmi.py) -> the tree's stdio pipes read empty by slurmstepd (output_pipes.py)
              ... barrier: all READY ...
    CAPTURE   record fds/files -> the GPU host copy into the images by several threads (host_copy.py),
              beside (periodic) or before (final) the criu dump into node-local staging (the tree stays
              frozen) -> output snapshot
              -> (final only) hand-over: a persister outside the job's cgroups takes the staged images to the
              store after Slurm's SIGKILL (store/handover.py commits the epoch once every rank's are there)
    RESUME    (periodic, every rank dumped) thaw -> GPU restore -> unlock -> memory limits put back
    PERSIST   (once the tree runs again) the staged images to the store at bounded priority
    then      COMMIT (coordinator's agent, atomic manifest rename) | final: hand-over record -> FINISH (kill)
    or        ABORT at any point -> the undos of what was done, in reverse: the previous commit stays.

GPU work comes before the freeze because the CUDA driver's checkpoint calls hang on a frozen or stopped
process (measured on the H200). The restore is a table of its own (restore.py).
"""
from __future__ import annotations

import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor, wait

from slurmckpt.cuda.interface import holds_gpu_state
from slurmckpt.criu import images as criu_images
from slurmckpt.cuda.procscan import inherited_device_majors
from slurmckpt.errors import CaptureError
from slurmckpt.node import host_memory, proctree, stopped, tcp_ports
from slurmckpt.rank import checks, ghost, host_copy, images, output_pipes, output_snapshot
from slurmckpt.rank.context import CaptureState, Phase, RankContext
from slurmckpt.rank.engine import Stage, Table
from slurmckpt.rank.sharing import ipc, netlock, shm_files
from slurmckpt.slurm import pmi
from slurmckpt.store.record import Files, GhostFile, HandedSocket, ScriptFd, Sockets, StdioFd, Tree, WrittenFile

log = logging.getLogger("slurmckpt.rank")


def _freeze(ctx: RankContext, st: CaptureState) -> None:
    if not st.replay:     # srun must keep relaying what the (frozen) steps already wrote to the output
        st.timings["freeze_wait"] = ctx.cgroup.freeze()


def _thaw(ctx: RankContext, st: CaptureState) -> None:
    ctx.cgroup.thaw()


def _gpu_lock(ctx: RankContext, st: CaptureState) -> None:
    ctx.gpu.lock(ctx.cgroup.pids())     # refuses unsupported GPU set-ups before anything is frozen


def _gpu_unlock(ctx: RankContext, st: CaptureState) -> None:
    ctx.gpu.unlock()


def _gpu_checkpoint(ctx: RankContext, st: CaptureState) -> None:
    """The driver's copy of each CUDA process's device memory into new memory of that process; that new
    memory (its host copy) is noted for CAPTURE to copy in parallel (host_copy.py)."""
    pids = ctx.cgroup.pids() if ctx.limits.host_copy_threads else []
    before = host_copy.anonymous_ranges(pids)
    st.gpu_record = ctx.gpu.checkpoint()
    if pids and holds_gpu_state(st.gpu_record):
        st.host_copies = host_copy.grown(before, host_copy.anonymous_ranges(pids))


def _gpu_resume(ctx: RankContext, st: CaptureState) -> None:
    ctx.gpu.resume()


def _raise_memory(ctx: RankContext, st: CaptureState) -> None:
    """Where the site lets root, the job's memory limits go up by what the GPU copy (and the images' page
    cache) add, as SIZE planned (rank/fit.py, node/host_memory.py); put back after the GPU restore."""
    if ctx.limits.memory_ledger is not None and st.footprint is not None and st.footprint.raises:
        st.memory_raised = host_memory.raise_limits(st.footprint.raises, ctx.limits.memory_ledger)


def put_back_memory(ctx: RankContext, st: CaptureState) -> None:
    """The raise taken back, always: a job left holding more than its own limit meets the kernel's
    enforcement of its --mem, as at any other time (said in the agent's log)."""
    if ctx.limits.memory_ledger is None or not st.memory_raised:
        return
    for over in host_memory.put_back(st.memory_raised, ctx.limits.memory_ledger):
        log.warning("%s", over, extra={"step": ctx.step, "rank": ctx.rank})
    st.memory_raised = []


def _pmi_between_exchanges(ctx: RankContext, st: CaptureState) -> None:
    """No PMI exchange under way, or the round is tried again (pmi.require_no_exchange). A replayed batch
    step is not frozen and not imaged: nothing to check."""
    h = ctx.handovers
    if h.pmi_fd >= 0 and not st.replay:
        pmi.require_no_exchange(h.pmi_fd, h.pmi_ino, ctx.cgroup.pids(), ctx.step, ctx.rank)


def _drain_output(ctx: RankContext, st: CaptureState) -> None:
    """After the freeze: what the tree wrote to its stdio pipes has been read by slurmstepd, so the batch
    rank's output snapshot (CAPTURE, after the barrier) can hold it (output_pipes.py)."""
    if not st.replay:
        output_pipes.wait_drained(ctx.creds, [pid for pid in (ctx.wrapper_pid, ctx.root_pid) if pid])


def _record(ctx: RankContext, st: CaptureState) -> None:
    pids = ctx.cgroup.pids()
    root = ctx.root_pid or 0
    ghosts = [] if st.replay else proctree.deleted_files(pids)
    st.ghost_limit = ghost.limit_for(ghosts, ctx.limits.ghost_limit_max, step=ctx.step, rank=ctx.rank)
    shm = [] if st.replay else shm_files.held(pids, ctx.creds.uid)
    stdio = [t for t in (proctree.fd_target(root, fd) for fd in (0, 1, 2)) if t]
    outputs = {t.link for t in stdio if t.regular}
    replay = st.replay
    view = proctree.MountView() if replay else proctree.mount_view(root)
    script = [] if replay or ctx.step != "batch" else _batch_script_fds(pids, ctx.store.job, view)
    # frozen since PREPARE: the moment this image holds (handover.py); a GPU tree's own mount namespace:
    # what it holds through the node's mounts is handed in again
    tree = Tree("replay" if replay else "image", time.time(), len(pids), socket.gethostname(), ctx.creds.uid,
                view.inside is not None, ctx.step_token)
    files = Files(
        tuple(StdioFd(t.fd, t.link, view.key(t), t.regular, t.size) for t in stdio),
        tuple(sorted({k for k in [view.key(t) for t in stdio] + [e.key for e in script] if k.startswith("file[")})),
        () if replay else tuple(WrittenFile(k, t.size, t.ino)
                                for k, t in proctree.written_files(pids, outputs).items()),
        # The batch shell reads its script from the node's spool (<SlurmdSpoolDir>/jobNNNNN/slurm_script),
        # which is elsewhere on another node: restored from the new start's script fd (same content).
        tuple(script),
        tuple(GhostFile(f.path, f.size, f.how) for f in ghosts),
        # a /dev/shm file saved below is written back at the restore: not fingerprinted (restore.py)
        () if replay else tuple(ipc.fingerprint_files(pids, [f for f in st.shared_files
                                                             if f not in {s.name for s in shm}])),
        tuple(shm_files.save(ctx.creds, shm, images.staged(ctx, st.epoch), st.copy_budget.charge)))
    sockets = Sockets() if replay else Sockets(
        tuple(_pmi_socket(ctx, pids)), tuple(_standin_sockets(ctx, pids)),
        # loopback TCP to other ranks of the job: held (netlock) while only one end is restored
        tuple((lo, re, step, int(rank)) for lo, re, step, rank in netlock.still_established(pids, st.tcp_peers)),
        *checks.tcp_leaving_the_node(st, pids),
        tcp_ports.record(pids))     # their own TIME_WAIT gone before a restore
    st.record.tree, st.record.files, st.record.sockets, st.record.gpu = tree, files, sockets, st.gpu_record
    images.staged(ctx, st.epoch)


SCRIPT_RE = re.compile(r"/job(\d+)/slurm_script$")


def _batch_script_fds(pids: list[int], job: int, view: proctree.MountView) -> list[ScriptFd]:
    """The tree's fds on this job's spooled batch script: criu key and file position (bash reads its
    script through such an fd as it goes; the restored one must continue where it was)."""
    found: dict[str, int] = {}
    for pid in pids:
        for t in proctree.open_files(pid):
            m = SCRIPT_RE.search(t.link)
            if m and int(m.group(1)) == job and view.key(t) not in found:
                found[view.key(t)] = proctree.fd_position(pid, t.fd)
    return [ScriptFd(k, pos) for k, pos in sorted(found.items())]


def _pmi_socket(ctx: RankContext, pids: list[int]) -> list[HandedSocket]:
    """The task's PMI socket to slurmstepd, if the tree holds it: criu key (idle: checked in PREPARE, and
    the tree has stayed frozen since)."""
    key = f"socket:[{ctx.handovers.pmi_ino}]"
    if ctx.handovers.pmi_fd < 0 or not any(t.link == key for pid in pids for t in proctree.open_files(pid)):
        return []
    return [HandedSocket(key, ctx.handovers.pmi_ino)]


def _standin_sockets(ctx: RankContext, pids: list[int]) -> list[HandedSocket]:
    """The srun stand-ins' sockets to the wrapper that the tree still holds, in a fixed order (the restore
    hands in one new socket for each)."""
    held = {t.link for pid in pids for t in proctree.open_files(pid)}
    return [HandedSocket(f"socket:[{ino}]", ino) for ino in sorted(ctx.handovers.standin_inos)
            if f"socket:[{ino}]" in held]


def _host_copy(ctx: RankContext, st: CaptureState) -> None:
    """A final capture, on the frozen tree, before criu: the GPU checkpoint's host copy into the images by
    several threads; criu then dumps those pages as untouched (host_copy.py). It must end before criu's
    dump begins: criu ends the tree once its dump is done."""
    if not st.record.imaged or not st.host_copies:
        return
    st.skip_pages = host_copy.skip_list(st.host_copies)
    _copy_host(ctx, st)


def _start_host_copy(ctx: RankContext, st: CaptureState) -> None:
    """A periodic capture: the host copy starts beside criu's dump (the next stage). The two read disjoint
    memory of the frozen tree (criu skips the copied pages, known before either starts), so the job's stall
    pays the longer of the two instead of their sum. Each is timed as if alone: a final capture's cost is
    judged from them (coordinator/budget.py), and there they run one after the other."""
    if not st.record.imaged or not st.host_copies:
        st.timings["host-copy"] = 0.0
        return
    st.skip_pages = host_copy.skip_list(st.host_copies)
    pool = ThreadPoolExecutor(1, thread_name_prefix="host-copy")
    st.host_copying = pool.submit(_copy_host, ctx, st)
    pool.shutdown(wait=False)       # the thread ends with the copy


def _copy_host(ctx: RankContext, st: CaptureState) -> None:
    start = time.monotonic()
    entries, _, seconds = host_copy.copy_out(st.host_copies, images.area(ctx, st.epoch),
                                             ctx.limits.host_copy_threads, step=ctx.step, rank=ctx.rank,
                                             epoch=st.epoch)
    st.record.host_copy = tuple(entries)
    st.timings["host_copy"] = seconds
    st.timings["host-copy"] = round(time.monotonic() - start, 4)


def _join_host_copy(ctx: RankContext, st: CaptureState) -> None:
    """Wait for a copy started beside the dump (never raises: the copy's own error is the dump stage's to
    raise). Its threads never outlive the capture's stages: the rollback discards the images they write."""
    if st.host_copying is not None:
        wait([st.host_copying])
        st.host_copying = None


def _dump_beside_host_copy(ctx: RankContext, st: CaptureState) -> None:
    """criu's dump while the host copy runs, then the copy's end: a failed dump is the error raised, else a
    failed copy."""
    copying, start = st.host_copying, time.monotonic()
    try:
        _dump(ctx, st)
    finally:
        st.timings["dump"] = round(time.monotonic() - start, 4)
        _join_host_copy(ctx, st)
    if copying is not None:
        copying.result()


def _dump(ctx: RankContext, st: CaptureState) -> None:
    """criu dump into the staging area. A final capture lets criu end the tree itself: it closes TCP sockets
    in repair mode, so no FIN and no TIME_WAIT holds the ports the restore must bind again (a plain kill
    after the dump would). An interrupted dump is the runner's to answer (runner.py: the tree dies)."""
    rec = st.record
    if not rec.imaged or rec.files is None or rec.sockets is None:  # a replayed batch step is not dumped (_record)
        return
    rdir = images.area(ctx, st.epoch)
    files = rec.files
    # a tree with CUDA processes stays stopped after a periodic dump: its GPU restore runs with only the
    # driver's restore threads running (cuda/rank_stage.py; docs/gpu.md)
    leave_stopped = not st.final and ctx.gpu.stops_for_resume()
    pids = ctx.cgroup.pids()
    tree = proctree.descendants(ctx.root_pid or 0)     # what criu dumps, and with leave_stopped stops
    stopped_before = stopped.stopped(tree)
    st.timings["criu_dump"] = ctx.criu.dump(
        ctx.root_pid or 0, rdir, leave_running=not st.final, freezer=ctx.cgroup.path, ghost_limit=st.ghost_limit,
        external=[f"unix[{e.ino}]" for e in rec.sockets.pmi + rec.sockets.srun_standins] + list(files.external),
        link_remap=any(e["removed"] for e in files.shm), mntns=rec.tree is not None and rec.tree.mntns,
        inherited_devices=inherited_device_majors(pids), leave_stopped=leave_stopped, skip_pages=st.skip_pages)
    if leave_stopped:     # (their state says so only after the thaw: criu's SIGSTOP waits behind the freeze)
        ctx.gpu.left_stopped(sorted(set(tree) - stopped_before))
    if st.final and ctx.packets.name == "nftables":       # criu left its lock's table: the job's end removes it
        netlock.note_criu_lock(ctx.store.job, criu_images.dump_run_id(rdir))
    shm_files.note_remaps(list(files.shm), rdir)
    shm_files.remove_links(ctx.creds, list(files.shm))     # put back by the restore, on any node
    if not st.final and ctx.cgroup.state() != "FROZEN":   # consistency depends on the tree staying frozen
        raise CaptureError("tree was thawed by the dump", epoch=st.epoch)


def _discard_images(ctx: RankContext, st: CaptureState) -> None:
    images.discard(ctx, st.epoch)


def _snapshot_output(ctx: RankContext, st: CaptureState) -> None:
    st.record.outputs = output_snapshot.take(ctx, st, images.area(ctx, st.epoch))


def _persist_resumed(ctx: RankContext, st: CaptureState) -> None:
    images.persist(ctx, st, background=True)       # beside the running tree, at bounded priority


PREPARE = Table("prepare", (
    Stage("check", checks.check_restorable),
    # the same PMI check on the running tree: a rank that sits in a long PMI barrier is sent back before its
    # GPU checkpoint, which each retried round would otherwise repeat (seconds per GiB); the check after the
    # freeze is the one that counts
    Stage("pmi-precheck", _pmi_between_exchanges),
    Stage("space", images.reserve, undo=images.release),
    Stage("memory", _raise_memory, undo=put_back_memory),
    Stage("gpu-lock", _gpu_lock, undo=_gpu_unlock),
    Stage("gpu-checkpoint", _gpu_checkpoint, undo=_gpu_resume),
    Stage("freeze", _freeze, undo=_thaw),
    Stage("pmi-idle", _pmi_between_exchanges),
    Stage("drain-output", _drain_output),
), running=Phase.PREPARING, reached=Phase.PREPARED)
# A periodic capture leaves its images in staging and the tree frozen; they persist after RESUME's thaw. Its
# host copy runs beside criu's dump.
PERIODIC_CAPTURE = Table("periodic-capture", (
    Stage("record", _record, undo=_discard_images),
    Stage("host-copy", _start_host_copy, undo=_join_host_copy, times_itself=True),
    Stage("dump", _dump_beside_host_copy, times_itself=True),
    Stage("snapshot-output", _snapshot_output),
), running=Phase.CAPTURING, reached=Phase.CAPTURED)
# A final capture ends inside Slurm's window once its images are complete in staging: a persister of its own
# takes them to the store after the job ended, outside the job's cgroups (images.hand_over; store/handover.py).
# Its host copy ends before criu's dump begins (criu ends the tree).
FINAL_CAPTURE = Table("final-capture", (
    Stage("record", _record, undo=_discard_images),
    Stage("host-copy", _host_copy),
    Stage("dump", _dump),
    Stage("snapshot-output", _snapshot_output),
    Stage("handover", images.hand_over, undo=images.stop_persister),
), running=Phase.CAPTURING, reached=Phase.HANDED_OVER)
# The tree runs on: its stages run whatever the others do (a tree left frozen or locked is worse than an
# error), and none is undone after (ABORT then drops the epoch's images).
RESUME = Table("resume", (
    Stage("thaw", _thaw),
    Stage("gpu-restore", _gpu_resume),
    Stage("gpu-unlock", _gpu_unlock),
    Stage("memory", put_back_memory),
), running=Phase.RESUMING, reached=Phase.RESUMED, settled=True)
# After RESUME of a periodic capture, once the tree runs again: its staged images go to the store at bounded
# priority (COMMIT needs every rank's).
PERSIST = Table("persist", (Stage("persist", _persist_resumed),), running=Phase.PERSISTING, reached=Phase.PERSISTED)
