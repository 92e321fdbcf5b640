"""Another process's memory, copied to and from a file with several threads (process_vm_readv/writev).

A GPU checkpoint (cuCheckpointProcessCheckpoint) copies the process's device memory into new anonymous
memory of the process, and the job stays stopped until that copy is in the images and the GPU restore has
taken it back. criu copies it through its parasite's pipes, one page batch and one process at a time, at
2.2-2.6 GB/s (docs/gpu.md); here each of `threads` threads moves its own 16 MiB chunks between the process
and the image file, so the copy runs at the speed of memory and of the file system's page cache. The
process is stopped or frozen throughout (the capture's freeze; the restore's stopped tree): nothing changes
under the copy. Root only: the caller is the rank's agent, acting on its own tree.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

CHUNK = 16 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("process_vm_readv", "process_vm_writev"):
    getattr(_libc, _name).restype = ctypes.c_ssize_t
    getattr(_libc, _name).argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                      ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


@dataclass(frozen=True)
class Span:
    """A range of a process's address space and where it lies in the file: [start, end) at `offset`."""
    start: int
    end: int
    offset: int

    @property
    def size(self) -> int:
        return self.end - self.start


def spans(ranges: Sequence[tuple[int, int]]) -> list[Span]:
    """The ranges laid end to end in one file."""
    out, offset = [], 0
    for start, end in ranges:
        out.append(Span(start, end, offset))
        offset += end - start
    return out


def _chunks(layout: list[Span]) -> list[tuple[int, int, int]]:
    return [(s.start + o, s.offset + o, min(CHUNK, s.size - o)) for s in layout for o in range(0, s.size, CHUNK)]


def _vm(call: Callable[..., int], pid: int, address: int, buf: ctypes.Array[ctypes.c_char], n: int,
        what: str) -> None:
    local = _IoVec(ctypes.addressof(buf), n)
    remote = _IoVec(address, n)
    done = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != n:
        err = ctypes.get_errno() if done < 0 else 0
        raise OSError(err or 5, f"{what} of pid {pid} at {address:#x}: {done} of {n} bytes"
                      + (f" ({os.strerror(err)})" if err else ""))


def _run(work: list[tuple[int, int, int]], threads: int, one: Callable[[ctypes.Array[ctypes.c_char], int, int, int], None]) -> None:
    """`one(buffer, address, offset, n)` for every chunk, spread over `threads` threads; the first error
    is raised once every thread stopped."""
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(work)

    def worker() -> None:
        buf = ctypes.create_string_buffer(CHUNK)
        while not errors:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            try:
                one(buf, *item)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors.append(e)
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def copy_out(pid: int, layout: list[Span], fd: int, threads: int) -> float:
    """The spans of `pid`'s memory into the file `fd` (written at each span's offset). Seconds taken."""
    t0 = time.monotonic()

    def one(buf: ctypes.Array[ctypes.c_char], address: int, offset: int, n: int) -> None:
        _vm(_libc.process_vm_readv, pid, address, buf, n, "reading the memory")
        view = memoryview(buf)[:n]
        while view:
            view = view[os.pwrite(fd, view, offset + n - len(view)):]
    _run(_chunks(layout), threads, one)
    return time.monotonic() - t0


def copy_in(pid: int, layout: list[Span], fd: int, threads: int) -> float:
    """The file `fd`'s spans back into `pid`'s memory at the same addresses. Seconds taken."""
    t0 = time.monotonic()

    def one(buf: ctypes.Array[ctypes.c_char], address: int, offset: int, n: int) -> None:
        got = 0
        view = memoryview(buf)
        while got < n:
            k = os.preadv(fd, [view[got:n]], offset + got)
            if k <= 0:
                raise OSError(5, f"the page file ended at {offset + got} of {offset + n}")
            got += k
        _vm(_libc.process_vm_writev, pid, address, buf, n, "writing the memory")
    _run(_chunks(layout), threads, one)
    return time.monotonic() - t0
