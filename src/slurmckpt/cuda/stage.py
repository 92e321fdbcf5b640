"""The GPU step of one rank's process tree: TreeGpuStage, the driver's calls on the tree's CUDA processes.

Capture (periodic):  lock_all -> checkpoint_all -> [CRIU dump --leave-running] -> restore_all -> unlock_all
Capture (final):     lock_all -> checkpoint_all -> [CRIU dump, the tree exits]
Restore:             [CRIU restore] -> adopt_restored -> restore_all(pairs) -> unlock_all
GPU lock and checkpoint run while the tree is still running (the driver's helper thread inside each process
does the work): they go before any freezer/CRIU freeze, and restore/unlock after the thaw.

Every failure rolls back what this stage did (restore what it checkpointed, unlock what it locked); a
rollback that itself fails raises GpuRollbackError naming the processes left behind. Locks and unlocks go one
process after another; checkpoints and restores run at once (threads: the driver copies several processes'
memory faster together), except in a cuda-checkpoint job (CUDA IPC, ipc_peers.py): one after another, in one
order. A tree with no process touching /dev/nvidia* gets a NullTreeGpuStage: libcuda is never loaded for it.
What a GPU job must do to be checkpointable, and what is refused before anything is locked: procscan.py.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence, TypeVar

from slurmckpt.cuda import ipc_peers
from slurmckpt.cuda.driver import GpuDriver, GpuDriverError, GpuInfo, GpuPair, ProcessState, load_driver
from slurmckpt.cuda.procscan import (condition, find_cuda_pids, frozen_reason, ns_pid, process_environ,
                                     unsupported_reasons)
from slurmckpt.cuda.release import release
from slurmckpt.cuda.remap import visible_gpus
from slurmckpt.errors import GpuError, LockContended
from slurmckpt.node import procfs, stopped as stopped_processes
from slurmckpt.node.stopped import PtraceError, running_alone

T = TypeVar("T")
log = logging.getLogger("slurmckpt.cuda")


class GpuUnsupportedError(GpuError):
    """The tree uses a GPU feature the CUDA checkpoint API cannot capture; nothing was locked or frozen."""

    def __init__(self, reasons: Sequence[str], **context: object) -> None:
        self.reasons = list(reasons)
        super().__init__("GPU state cannot be checkpointed: " + "; ".join(self.reasons), **context)


class GpuStateError(GpuError):
    """A process is not in the state this step needs (locked or checkpointed by someone else)."""


class GpuRollbackError(GpuError):
    """Rolling back failed: `stuck` maps pid -> state it was left in. The tree must not be left running."""

    def __init__(self, message: str, stuck: dict[int, str], **context: object) -> None:
        self.stuck = stuck
        super().__init__(f"{message}; left behind: " + ", ".join(f"pid {p} {_left(s)}" for p, s in stuck.items()),
                         **context)


def _left(state: str) -> str:
    # NO_CUDA after a checkpoint: the driver dropped the process's GPU state; it cannot run on correctly
    return f"{state} (its GPU state is lost)" if state == "NO_CUDA" else state


def _refuse_frozen(pid: int, cgroup_root: str, context: dict[str, Any] | None, stopped_ok: bool = False) -> None:
    why = frozen_reason(pid, cgroup_root, stopped_ok)
    if why:
        raise GpuStateError(f"{why}: the CUDA checkpoint API hangs on a process that cannot run; lock and "
                            f"checkpoint GPUs before freezing the tree, thaw it before GPU restore/unlock",
                            pid=pid, **(context or {}))


# ---- the stage --------------------------------------------------------------------------------------------
@dataclass
class GpuProcess:
    pid: int
    ns_pid: int | None
    initial: ProcessState
    locked: bool = False            # by this stage (LOCKED or CHECKPOINTED through us)
    checkpointed: bool = False      # by this stage (or adopted after a CRIU restore)
    restore_tid: int | None = None  # the driver's restore thread in it (host tid)

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "ns_pid": self.ns_pid, "initial": self.initial.name}


@dataclass
class TreeGpuStage:
    driver: GpuDriver
    processes: list[GpuProcess]
    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_visible_devices: str | None = None
    adopted: bool = False
    context: dict[str, Any] = field(default_factory=dict)
    cgroup_root: str = "/sys/fs/cgroup"
    concurrent: bool = True      # checkpoint and restore the processes at once (one driver call each)
    exit_grace_s: float = 10.0   # how long a rollback waits for a process whose GPU state went unreadable to end
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    ended: list[int] = field(default_factory=list)      # pids that ended during a step (_release_ended)
    stopped: bool = False        # criu left the tree stopped: each driver call runs the restore thread alone
    ipc_job: bool = False        # CUDA IPC in one cuda-checkpoint job: every call in turn, in process order
    run_alone: Callable[[int], ContextManager[None]] = running_alone
    let_go: Callable[[list[int]], None] = stopped_processes.let_go    # a stopped process given the chance to end
    active = True

    # ---- construction ----
    @classmethod
    def for_tree(cls, pids: Sequence[int], *, driver_factory: Callable[[], GpuDriver] = load_driver,
                 nccl_env_required: bool = True, cgroup_root: str = "/sys/fs/cgroup",
                 context: dict[str, Any] | None = None,
                 release_of: Callable[[], tuple[int, ...] | None] = release) -> TreeGpuStage | NullTreeGpuStage:
        """Capture side, on the running (not yet frozen) tree. Refuses (GpuUnsupportedError, GpuStateError)
        before anything is locked."""
        candidates = find_cuda_pids(pids)
        if not candidates:
            return NullTreeGpuStage()
        driver_release = release_of()
        reasons = unsupported_reasons(candidates, nccl_env_required, driver_release)
        if reasons:
            raise GpuUnsupportedError(reasons, **(context or {}))
        for pid in candidates:
            _refuse_frozen(pid, cgroup_root, context)
        driver = driver_factory()
        ipc_job = ipc_peers.job_members(candidates, driver_release)
        if ipc_job and not driver.ipc_jobs():
            raise GpuUnsupportedError(["CUDA IPC in a cuda-checkpoint job, which this driver does not checkpoint"],
                                      **(context or {}))
        procs = []
        for pid in candidates:
            try:
                state = driver.state(pid)
            except GpuDriverError as e:
                if e.code == 304:
                    continue
                raise
            if state is ProcessState.NO_CUDA:      # forked from a CUDA process: its device maps are
                continue                            # reservations to criu (procscan.inherited_device_majors)
            if state is not ProcessState.RUNNING:
                raise GpuStateError(f"process {pid} is already {state.name} (another tool is checkpointing it)",
                                    pid=pid, **(context or {}))
            procs.append(GpuProcess(pid, ns_pid(pid), state, restore_tid=driver.restore_thread(pid)))
        if not procs:
            return NullTreeGpuStage()
        env = process_environ(procs[0].pid)
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        gpus = visible_gpus(driver.devices(), cvd, env.get("CUDA_DEVICE_ORDER"))
        return cls(driver, procs, gpus, cvd, context=dict(context or {}), cgroup_root=cgroup_root, ipc_job=ipc_job)

    @classmethod
    def adopt_restored(cls, driver: GpuDriver, record: dict[str, Any], tree_pids: Sequence[int],
                       context: dict[str, Any] | None = None, cgroup_root: str = "/sys/fs/cgroup",
                       run_alone: Callable[[int], ContextManager[None]] = running_alone) -> TreeGpuStage:
        """Restore side: the processes of `record` (capture order), found among the CRIU-restored tree, which
        criu left stopped, by their PID-namespace pid (host pids change). Each must be CHECKPOINTED."""
        by_ns = {ns_pid(p): p for p in tree_pids}
        procs = []
        for item in record.get("processes", []):
            host = by_ns.get(item["ns_pid"]) if item.get("ns_pid") is not None else item["pid"]
            if host is None:
                raise GpuStateError(f"restored tree has no process with namespace pid {item['ns_pid']}",
                                    **(context or {}))
            try:
                tid = driver.restore_thread(host)
            except GpuDriverError as e:
                raise GpuStateError(f"restored process {host} has no GPU restore thread ({e.result}): "
                                    f"{condition(host)}", pid=host, **(context or {})) from e
            procs.append(GpuProcess(host, item.get("ns_pid"), ProcessState.CHECKPOINTED, locked=True,
                                    checkpointed=True, restore_tid=tid))
        gpus = [GpuInfo.from_dict(g) for g in record.get("gpus", [])]
        stage = cls(driver, procs, gpus, record.get("cuda_visible_devices"), adopted=True,
                    context=dict(context or {}), cgroup_root=cgroup_root, stopped=True, run_alone=run_alone,
                    ipc_job=bool(record.get("ipc_job")))
        for p in procs:
            try:
                state = stage._drv(p, lambda: driver.state(p.pid))
            except GpuDriverError as e:
                raise GpuStateError(f"GPU state of restored process {p.pid} unreadable ({e.result}): "
                                    f"{condition(p.pid)}", pid=p.pid, **(context or {})) from e
            if state is not ProcessState.CHECKPOINTED:
                raise GpuStateError(f"restored process {p.pid} is {state.name}, expected CHECKPOINTED",
                                    pid=p.pid, **(context or {}))
        return stage

    def record(self) -> dict[str, Any]:
        """What the manifest keeps for the restore: processes in checkpoint order, the GPUs they saw."""
        return {"processes": [p.to_dict() for p in self.processes], "gpus": [g.to_dict() for g in self.gpus],
                "cuda_visible_devices": self.cuda_visible_devices, **({"ipc_job": True} if self.ipc_job else {})}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- the steps ----
    def lock_all(self, timeout_ms: int) -> None:
        # one after another, stopping at the first contended lock: a lock is ~1 ms, and a lock round that
        # failed is tried again as a whole (docs/architecture.md, "GPU lock rounds")
        self._each("lock", lambda p: not p.locked, lambda p: self._lock(p, timeout_ms), together=False)

    def checkpoint_all(self) -> None:
        for p in self.processes:
            if not p.locked:
                raise GpuStateError(f"checkpoint of process {p.pid} before it was locked", pid=p.pid)
        self._each("checkpoint", lambda p: not p.checkpointed, self._checkpoint, together=not self.ipc_job)

    def restore_all(self, pairs: Sequence[GpuPair] | None = None) -> None:
        """GPU state back onto the GPUs (full old->new `pairs` when remapped); processes stay LOCKED."""
        if self.adopted:     # nothing of the previous run to go back to: the caller kills the tree on failure
            self._all("restore", [p for p in self.processes if p.checkpointed], lambda p: self._restore(p, pairs),
                      together=not self.ipc_job)
            return
        self._each("restore", lambda p: p.checkpointed, lambda p: self._restore(p, pairs), together=not self.ipc_job)

    def unlock_all(self) -> None:
        errors: list[GpuError] = []
        for p in self.processes:
            if p.locked and not p.checkpointed:
                try:
                    self._call("unlock", p, lambda: self.driver.unlock(p.pid))
                    p.locked = False
                except GpuError as e:
                    errors.append(e)
        if errors:
            raise GpuRollbackError("unlock failed", self._stuck(), **self.context) from errors[0]

    def rollback(self) -> None:
        """Back to the initial state: restore what we checkpointed, unlock what we locked (driver's word on
        each process's state, not ours: a failed call may have moved it). GpuRollbackError if any is stuck."""
        for p in self.processes:
            if not p.locked:
                continue
            try:
                if self._drv(p, lambda: self._back_to_running(p)) is ProcessState.RUNNING:
                    p.locked = p.checkpointed = False
            except GpuError as e:
                log.error("GPU rollback of pid %d failed: %s (%s)", p.pid, e, condition(p.pid),
                          extra={"pid": p.pid, **self.context})
        self._release_ended()
        stuck = self._stuck()
        if stuck:
            raise GpuRollbackError("GPU rollback failed", stuck, **self.context)

    # ---- internals ----
    def _back_to_running(self, p: GpuProcess) -> ProcessState:
        state = self.driver.state(p.pid)
        if state is ProcessState.CHECKPOINTED:
            self.driver.restore(p.pid, None)
            state = ProcessState.LOCKED
        if state is ProcessState.LOCKED:
            self.driver.unlock(p.pid)
            state = ProcessState.RUNNING
        return state

    def _drv(self, p: GpuProcess, fn: Callable[[], T]) -> T:
        """A driver call on `p`, refused while p is frozen or stopped (the driver's calls hang there), unless
        criu left the tree stopped (`stopped`): then p's restore thread runs alone for the call."""
        if not self.stopped:
            _refuse_frozen(p.pid, self.cgroup_root, self.context)
            return fn()
        _refuse_frozen(p.pid, self.cgroup_root, self.context, stopped_ok=True)
        # the tid comes from the driver inside the user's process: root seizes it only as a thread of p
        if p.restore_tid is None or p.restore_tid not in procfs.threads(p.pid):
            raise GpuStateError(f"process {p.pid} is stopped and {p.restore_tid} is not a GPU restore thread of "
                                "it", pid=p.pid, **self.context)
        try:
            with self.run_alone(p.restore_tid):
                return fn()
        except PtraceError as e:
            raise GpuStateError(f"cannot run the GPU restore thread {p.restore_tid} of process {p.pid} alone: "
                                f"{e.strerror}; {condition(p.pid)}", pid=p.pid, **self.context) from e

    def _release_ended(self) -> None:
        """A process whose GPU state the driver can no longer read, and which then ends within exit_grace_s,
        was exiting when the capture came: its program was tearing its CUDA context down (driver 580 answers
        CUDA_ERROR_OPERATING_SYSTEM then; seen on the H100 when a capture met a DataLoader job's exit). Its GPU
        state goes with it: nothing is lost and nothing is left to roll back. One that does not end is stuck,
        and the tree is killed (runner.py). A process criu left stopped cannot end: it is let go first (if it
        runs on without its GPU state, it is killed with its tree, and what it wrote meanwhile is cut back by
        the restore of the previous commit)."""
        waiting = [p for p in self.processes if p.locked and self._unreadable(p)]
        if waiting and self.stopped:
            self.let_go([p.pid for p in waiting])
        deadline = self.clock() + self.exit_grace_s
        while waiting:
            for p in [p for p in waiting if procfs.ended(p.pid)]:
                log.warning("pid %d ended during the GPU capture (its program was exiting): nothing to roll back",
                            p.pid, extra={"pid": p.pid, **self.context})
                p.locked = p.checkpointed = False
                self.ended.append(p.pid)
                waiting.remove(p)
            if not waiting or self.clock() >= deadline:
                return
            self.sleep(0.1)

    def _unreadable(self, p: GpuProcess) -> bool:
        try:
            self._drv(p, lambda: self.driver.state(p.pid))
        except GpuDriverError:
            return True
        except GpuError:          # frozen: not this case
            return False
        return False

    def _lock(self, p: GpuProcess, timeout_ms: int) -> None:
        """A lock that timed out (work in flight) is the one failure a lock round retries: LockContended."""
        try:
            self._call("lock", p, lambda: self.driver.lock(p.pid, timeout_ms))
        except GpuDriverError as e:
            if not e.timed_out:
                raise
            raise LockContended(f"GPU lock of pid {p.pid} timed out after {timeout_ms} ms ({e.result}): work "
                                "still in flight, e.g. a collective waiting for a peer", pid=p.pid,
                                **self.context) from e
        p.locked = True

    def _checkpoint(self, p: GpuProcess) -> None:
        self._call("checkpoint", p, lambda: self.driver.checkpoint(p.pid))
        p.checkpointed = True

    def _restore(self, p: GpuProcess, pairs: Sequence[GpuPair] | None) -> None:
        self._call("restore", p, lambda: self.driver.restore(p.pid, pairs))
        p.checkpointed = False

    def _call(self, op: str, p: GpuProcess, fn: Callable[[], None]) -> None:
        log.debug("GPU %s pid %d", op, p.pid, extra={"pid": p.pid, **self.context})
        self._drv(p, fn)

    def _each(self, op: str, wanted: Callable[[GpuProcess], bool], fn: Callable[[GpuProcess], None],
              together: bool = True) -> None:
        """Run `fn` on every wanted process at once (the driver copies several processes' memory faster
        together than one after another: docs/gpu.md, "Several GPU processes"); once all calls are back, on
        a failure (the first in process order) roll everything back and re-raise it."""
        try:
            self._all(op, [p for p in self.processes if wanted(p)], fn, together)
        except _Failed as f:
            pid, e = f.pid, f.error
        else:
            return
        log.warning("GPU %s of pid %d failed (%s); rolling back", op, pid, e, extra={"pid": pid, **self.context})
        try:
            self.rollback()
        except GpuRollbackError as rb:
            raise GpuRollbackError(f"GPU {op} of pid {pid} failed ({e}); rolling back failed", rb.stuck,
                                   **self.context) from e
        if pid in self.ended:
            raise GpuStateError(f"GPU {op} of pid {pid} failed ({e}): the process ended during the capture (its "
                                "program was exiting)", pid=pid, **self.context) from e
        raise e

    def _all(self, op: str, todo: list[GpuProcess], fn: Callable[[GpuProcess], None], together: bool = True) -> None:
        """`fn` on every process of `todo`, at once where there are several (ctypes lets go of the GIL
        inside the driver's calls); _Failed with the first failure in process order, once all are back."""
        failed: dict[int, BaseException] = {}
        if len(todo) <= 1 or not (self.concurrent and together):
            for p in todo:
                try:
                    fn(p)
                except BaseException as e:
                    failed[p.pid] = e
                    break
        else:
            with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix=f"gpu-{op}") as pool:
                futures = {p.pid: pool.submit(fn, p) for p in todo}
            failed = {pid: err for pid, f in futures.items() if (err := f.exception()) is not None}
        if failed:
            pid = next(p.pid for p in todo if p.pid in failed)
            raise _Failed(pid, failed[pid])

    def _stuck(self) -> dict[int, str]:
        return {p.pid: self._state_name(p) for p in self.processes if p.locked}

    def _state_name(self, p: GpuProcess) -> str:
        try:
            return self._drv(p, lambda: self.driver.state(p.pid)).name
        except GpuStateError:
            return "FROZEN"
        except GpuError:
            return "UNKNOWN"


class _Failed(Exception):
    def __init__(self, pid: int, error: BaseException) -> None:
        super().__init__(pid, error)
        self.pid, self.error = pid, error


class NullTreeGpuStage:
    """The GPU step of a tree without CUDA state: every step is a no-op, libcuda is never loaded."""
    active = False
    processes: list[GpuProcess] = []
    gpus: list[GpuInfo] = []
    pids: list[int] = []

    def lock_all(self, timeout_ms: int) -> None: ...
    def checkpoint_all(self) -> None: ...
    def restore_all(self, pairs: Sequence[GpuPair] | None = None) -> None: ...
    def unlock_all(self) -> None: ...
    def rollback(self) -> None: ...

    def record(self) -> dict[str, Any]:
        return {"processes": [], "gpus": [], "cuda_visible_devices": None}
