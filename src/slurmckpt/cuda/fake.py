"""A GpuDriver without a GPU: the checkpoint state machine, lock timeouts and NCCL-like collectives.

State machine (what driver 580 does, as far as it matters to us):
    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING
Any other transition fails with CUDA_ERROR_ILLEGAL_STATE and leaves the state alone; a pid the fake does not
know fails with CUDA_ERROR_OPERATING_SYSTEM; a registered process without CUDA reports NO_CUDA.

Lock waits for submitted GPU work. Work that can only finish when peers act is a collective: a process that
entered a collective that not every member has entered yet has a kernel spinning on the GPU, so its lock waits
`timeout_ms` (through the injected `sleep`) and then fails with CUDA_ERROR_NOT_READY, leaving it RUNNING. A
locked (or checkpointed) process makes no progress, so it never enters a collective: one locked peer blocks the
lock of every peer that already entered. `step()` lets every RUNNING process enter its next collective (the
workload making progress between lock rounds). Thread-safe: lock rounds call it from several threads.

CUDA IPC (`share_ipc`): processes that share device memory. A driver older than IPC_JOB_RELEASE refuses their
checkpoint (CUDA_ERROR_NOT_SUPPORTED; what 580 answers is for tests/gpu/ipc_probe.py to show). From that
release on, what the public cuda-checkpoint sources say (docs/gpu.md, "CUDA IPC"): members of one
cuda-checkpoint job are checkpointed once every member is locked, one at a time, and restored in the order
they were checkpointed; outside a job, or out of that order, the checkpoint hangs (seen on 610 with
gVisor), which the fake turns into an AssertionError, as for a call on a stopped process.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from slurmckpt.cuda.driver import (CUDA_ERROR_NOT_READY, CUDA_ERROR_OPERATING_SYSTEM, GpuDriverError, GpuInfo,
                                   GpuPair, ProcessState)
from slurmckpt.cuda.release import ipc_jobs

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_SUPPORTED = 801
RESTORE_TID_OFFSET = 100_000

OPS = {"lock": "cuCheckpointProcessLock", "checkpoint": "cuCheckpointProcessCheckpoint",
       "restore": "cuCheckpointProcessRestore", "unlock": "cuCheckpointProcessUnlock",
       "state": "cuCheckpointProcessGetState"}


def fake_gpus(n: int, name: str = "NVIDIA H200", memory: int = 150_754_820_096, tag: int = 0) -> list[GpuInfo]:
    return [GpuInfo(i, f"GPU-{tag:08x}-0000-4000-8000-{i:012x}", name, memory, f"0000:{0x18 + i:02X}:00.0")
            for i in range(n)]


@dataclass
class FakeProcess:
    pid: int
    state: ProcessState = ProcessState.RUNNING
    gpus: tuple[str, ...] = ()            # uuids the process's contexts live on
    busy_until: float = 0.0               # plain kernel in flight until this clock time


@dataclass
class FakeCollective:
    """One collective call (an all-reduce, say) over `members`; complete once every member entered it."""
    name: str
    members: tuple[int, ...]
    entered: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.entered >= set(self.members)

    def pending_for(self, pid: int) -> bool:
        return pid in self.entered and not self.complete


class FakeGpuDriver:
    def __init__(self, gpus: Sequence[GpuInfo] | None = None, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, release: tuple[int, ...] = (580, 159, 4)) -> None:
        self.release = release
        self._ipc: list[tuple[frozenset[int], bool]] = []     # (members, started in one cuda-checkpoint job)
        self._copying: set[int] = set()                       # IPC members inside a checkpoint or restore call
        self._checkpoint_order: list[int] = []                # IPC members, in the order they were checkpointed
        self._gpus = list(gpus if gpus is not None else fake_gpus(1))
        self._sleep, self._clock = sleep, clock
        self._procs: dict[int, FakeProcess] = {}
        self._collectives: list[FakeCollective] = []
        self._faults: dict[tuple[str, int], int] = {}
        self._mutex = threading.RLock()
        self.calls: list[tuple[str, int]] = []
        self.restore_pairs: dict[int, list[GpuPair] | None] = {}
        self.stopped: set[int] = set()        # processes criu left stopped: calls need their restore thread
        self.alone: set[int] = set()          # restore threads running alone now (run_alone)
        self.ran_alone: list[int] = []

    # ---- scenario set-up ----
    def add_process(self, pid: int, *, cuda: bool = True, gpus: Sequence[str] | None = None,
                    state: ProcessState = ProcessState.RUNNING) -> FakeProcess:
        with self._mutex:
            used = tuple(gpus) if gpus is not None else (self._gpus[0].uuid,) if cuda and self._gpus else ()
            p = FakeProcess(pid, state if cuda else ProcessState.NO_CUDA, used)
            self._procs[pid] = p
            return p

    def remove_process(self, pid: int) -> None:
        with self._mutex:
            self._procs.pop(pid, None)

    def set_gpus(self, gpus: Sequence[GpuInfo]) -> None:
        """The node's GPUs (a restore on another node or allocation)."""
        with self._mutex:
            self._gpus = list(gpus)

    def busy(self, pid: int, seconds: float) -> None:
        """A plain kernel that runs `seconds` more (lock succeeds if its timeout outlasts it)."""
        with self._mutex:
            self._procs[pid].busy_until = self._clock() + seconds

    def collective(self, members: Sequence[int], name: str = "allreduce") -> FakeCollective:
        with self._mutex:
            c = FakeCollective(name, tuple(members))
            self._collectives.append(c)
            return c

    def enter(self, coll: FakeCollective, pid: int) -> bool:
        """`pid` reaches `coll` in its program. A process that is not RUNNING makes no progress: False."""
        with self._mutex:
            if self._procs[pid].state is not ProcessState.RUNNING:
                return False
            coll.entered.add(pid)
            return True

    def step(self) -> None:
        """Every RUNNING process enters each incomplete collective it belongs to and has not entered yet."""
        with self._mutex:
            for c in self._collectives:
                if c.complete:
                    continue
                for pid in c.members:
                    if pid not in c.entered and self._procs[pid].state is ProcessState.RUNNING:
                        c.entered.add(pid)

    def share_ipc(self, pids: Sequence[int], job: bool = False) -> None:
        """`pids` share device memory through CUDA IPC; `job`: they were started in one cuda-checkpoint job."""
        with self._mutex:
            self._ipc.append((frozenset(pids), job))

    def ipc_jobs(self) -> bool:
        return ipc_jobs(self.release)

    def fail_next(self, op: str, pid: int, code: int = 999) -> None:
        """The next `op` ("lock", "checkpoint", "restore", "unlock") on `pid` fails with `code`; the state stays."""
        with self._mutex:
            self._faults[(op, pid)] = code

    def states(self) -> dict[int, ProcessState]:
        with self._mutex:
            return {pid: p.state for pid, p in self._procs.items()}

    # ---- GpuDriver ----
    def state(self, pid: int) -> ProcessState:
        with self._mutex:
            return self._proc("state", pid).state

    def lock(self, pid: int, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be > 0")
        with self._mutex:
            p = self._enter("lock", pid, ProcessState.RUNNING)
            if not self._has_work(p):
                p.state = ProcessState.LOCKED
                return
        self._sleep(timeout_ms / 1000.0)             # wait for the work, without holding the mutex
        with self._mutex:
            p = self._proc("lock", pid)
            if p.state is not ProcessState.RUNNING or self._has_work(p):
                raise GpuDriverError(OPS["lock"], CUDA_ERROR_NOT_READY, pid=pid)
            p.state = ProcessState.LOCKED

    def checkpoint(self, pid: int) -> None:
        with self._mutex:
            p = self._enter("checkpoint", pid, ProcessState.LOCKED)
            peers = self._ipc_peers("checkpoint", pid)
            if peers is None:
                p.state = ProcessState.CHECKPOINTED
                return
            running = sorted(q for q in peers if self._procs[q].state is ProcessState.RUNNING)
            if running:
                raise AssertionError(f"checkpoint of IPC job member {pid} while {running} run: the real driver "
                                     "would hang (lock every member first)")
        self._copy(pid, peers)
        with self._mutex:
            p.state = ProcessState.CHECKPOINTED
            self._checkpoint_order.append(pid)

    def restore(self, pid: int, pairs: Sequence[GpuPair] | None = None) -> None:
        with self._mutex:
            p = self._enter("restore", pid, ProcessState.CHECKPOINTED)
            peers = self._ipc_peers("restore", pid)
            if peers is not None:       # (a process restored from images has no order here: its own)
                first = next((q for q in self._checkpoint_order if q in peers | {pid}), pid)
                if first != pid:
                    raise AssertionError(f"restore of IPC job member {pid} before {first}: the real driver would "
                                         "hang (restore in the order of the checkpoints)")
        if peers is not None:
            self._copy(pid, peers)
        with self._mutex:
            here = {g.uuid for g in self._gpus}
            if pairs:
                remap = dict(pairs)
                if not set(p.gpus) <= set(remap) or not set(remap.values()) <= here:
                    raise GpuDriverError(OPS["restore"], CUDA_ERROR_INVALID_VALUE, pid=pid,
                                         detail="GPU pairs must list every checkpointed GPU and name GPUs present")
                p.gpus = tuple(remap[u] for u in p.gpus)
            elif not set(p.gpus) <= here:
                raise GpuDriverError(OPS["restore"], CUDA_ERROR_INVALID_VALUE, pid=pid,
                                     detail="checkpointed GPU absent and no GPU pairs given")
            self.restore_pairs[pid] = list(pairs) if pairs else None
            p.state = ProcessState.LOCKED
            if pid in self._checkpoint_order:
                self._checkpoint_order.remove(pid)

    def unlock(self, pid: int) -> None:
        with self._mutex:
            self._enter("unlock", pid, ProcessState.LOCKED).state = ProcessState.RUNNING

    def restore_thread(self, pid: int) -> int:
        """A made-up tid (the fake's processes have no threads): the pid + RESTORE_TID_OFFSET. Answered for a
        stopped process too (CRIU's cuda plugin asks for it then)."""
        with self._mutex:
            if pid not in self._procs:
                raise GpuDriverError("cuCheckpointProcessGetRestoreThreadId", CUDA_ERROR_OPERATING_SYSTEM, pid=pid)
            return pid + RESTORE_TID_OFFSET

    def devices(self) -> list[GpuInfo]:
        with self._mutex:
            return list(self._gpus)

    @contextmanager
    def run_alone(self, tid: int) -> Iterator[None]:
        """Stands in for node/stopped.running_alone: the restore thread `tid` runs while its process stays
        stopped."""
        with self._mutex:
            self.alone.add(tid)
            self.ran_alone.append(tid)
        try:
            yield
        finally:
            with self._mutex:
                self.alone.discard(tid)

    # ---- internals ----
    def _ipc_peers(self, op: str, pid: int) -> frozenset[int] | None:
        """The other members of `pid`'s IPC group (None: it shares nothing), refusing what the driver does."""
        group = next(((members, job) for members, job in self._ipc if pid in members), None)
        if group is None:
            return None
        if not ipc_jobs(self.release):
            raise GpuDriverError(OPS[op], CUDA_ERROR_NOT_SUPPORTED, pid=pid, detail="CUDA IPC")
        if not group[1]:
            raise AssertionError(f"{op} of pid {pid}, which shares CUDA IPC outside a cuda-checkpoint job: the "
                                 "real driver would hang")
        return group[0] - {pid}

    def _copy(self, pid: int, peers: frozenset[int]) -> None:
        """A checkpoint or restore of an IPC job member takes a while, without the mutex: another member's
        call meanwhile is the concurrency the driver does not take."""
        with self._mutex:
            busy = sorted(self._copying & peers)
            if busy:
                raise AssertionError(f"IPC job members {busy} and {pid} in the driver at once: one after another")
            self._copying.add(pid)
        time.sleep(0.02)
        with self._mutex:
            self._copying.discard(pid)

    def _proc(self, op: str, pid: int) -> FakeProcess:
        if pid in self.stopped and pid + RESTORE_TID_OFFSET not in self.alone:
            raise AssertionError(f"{OPS[op]} on stopped process {pid} with its restore thread stopped too: the "
                                 "real driver would hang")
        p = self._procs.get(pid)
        if p is None:
            raise GpuDriverError(OPS[op], CUDA_ERROR_OPERATING_SYSTEM, pid=pid)
        return p

    def _enter(self, op: str, pid: int, need: ProcessState) -> FakeProcess:
        self.calls.append((op, pid))
        p = self._proc(op, pid)
        code = self._faults.pop((op, pid), None)
        if code is not None:
            raise GpuDriverError(OPS[op], code, pid=pid, detail="injected fault")
        if p.state is ProcessState.NO_CUDA:
            raise GpuDriverError(OPS[op], 3, pid=pid)
        if p.state is not need:
            raise GpuDriverError(OPS[op], CUDA_ERROR_ILLEGAL_STATE, pid=pid,
                                 detail=f"process is {p.state.name}, needs {need.name}")
        return p

    def _has_work(self, p: FakeProcess) -> bool:
        return p.busy_until > self._clock() or any(c.pending_for(p.pid) for c in self._collectives)
