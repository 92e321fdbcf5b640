"""Processes that criu left stopped (`--leave-stopped`): one thread of such a process run alone, and the
processes let go again. The kernel's ptrace and job-control signals, in one place.

The CUDA driver restores a process's GPU state through a thread of its own inside the process (the restore
thread), so that thread must run for the driver's restore and unlock calls, while no other thread of the process
may: a thread that runs on while its process's GPU state is still checkpointed can reach GPU memory that is
not back yet (JAX did, and died, on the H200: docs/gpu.md, "The GPU restore runs while the tree is stopped").
CRIU's own cuda plugin (plugins/cuda/cuda_plugin.c, resume_device) keeps the process stopped the same way: it
seizes the restore thread, blocks every signal in it but SIGTRAP, lets it run, and interrupts it afterwards.

ptrace binds a tracee to the thread that seized it: every call of `running_alone` makes all its ptrace calls from
the calling thread, so GPU restores of several processes can run at once, one thread each.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from slurmckpt.node import procfs

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_GETSIGMASK = 0x420A
PTRACE_SETSIGMASK = 0x420B
WALL = 0x40000000               # __WALL: wait for a thread that is not the leader too
SIGTRAP_BIT = 1 << (signal.SIGTRAP - 1)



@functools.lru_cache(maxsize=1)
def _ptrace_fn() -> Any:
    """libc's ptrace, opened on first use (importing slurmckpt loads no library)."""
    fn = ctypes.CDLL(None, use_errno=True).ptrace
    fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_long
    return fn


class PtraceError(OSError):
    pass


def _ptrace(request: int, tid: int, addr: int | None = None, data: object = None) -> None:
    if _ptrace_fn()(request, tid, addr, data) == -1:
        e = ctypes.get_errno()
        raise PtraceError(e, f"ptrace({request:#x}) of thread {tid}: {os.strerror(e)}")


def _wait_stop(tid: int, timeout_s: float) -> None:
    """Until `tid` reports a ptrace stop; PtraceError if it ends or does not stop in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        got, status = os.waitpid(tid, os.WNOHANG | WALL)
        if got == tid:
            if os.WIFSTOPPED(status):
                return
            raise PtraceError(errno.ESRCH, f"thread {tid} ended while seized (status {status:#x})")
        if time.monotonic() >= deadline:
            raise PtraceError(errno.ETIMEDOUT, f"thread {tid} did not stop within {timeout_s:g} s")
        time.sleep(0.002)


@contextmanager
def running_alone(tid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """Thread `tid` runs, with every signal but SIGTRAP blocked, while every other thread of its process stays
    stopped; afterwards its signal mask is put back and it is detached, back into its process's stop."""
    _ptrace(PTRACE_SEIZE, tid)
    try:
        try:     # a thread seized in its process's stop reports that stop; one that runs is interrupted
            _wait_stop(tid, 0.2)
        except PtraceError as e:
            if e.errno != errno.ETIMEDOUT:
                raise
            _ptrace(PTRACE_INTERRUPT, tid)
            _wait_stop(tid, timeout_s)
        saved, block = ctypes.c_uint64(0), ctypes.c_uint64(~SIGTRAP_BIT & (2 ** 64 - 1))
        _ptrace(PTRACE_GETSIGMASK, tid, 8, ctypes.byref(saved))
        _ptrace(PTRACE_SETSIGMASK, tid, 8, ctypes.byref(block))
        _ptrace(PTRACE_CONT, tid, None, None)
        try:
            yield
        finally:
            _ptrace(PTRACE_INTERRUPT, tid)
            _wait_stop(tid, timeout_s)
            _ptrace(PTRACE_SETSIGMASK, tid, 8, ctypes.byref(saved))
    finally:
        try:
            _ptrace(PTRACE_DETACH, tid)
        except PtraceError:
            pass         # it ended; nothing holds it


def stopped(pids: Sequence[int]) -> set[int]:
    """The processes of `pids` in a job-control stop (state T) now."""
    out = set()
    for pid in pids:
        try:
            if procfs.stat(pid).state == "T":
                out.add(pid)
        except OSError:
            continue
    return out


def let_go(pids: Sequence[int]) -> None:
    """SIGCONT to each of `pids` (those criu left stopped; a process that ended since is skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
