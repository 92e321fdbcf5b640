"""Another process's memory, copied to and from a file with several threads (process_vm_readv/writev).

A GPU checkpoint (cuCheckpointProcessCheckpoint) copies the process's device memory into new anonymous
memory of the process, and the job stays stopped until that copy is in the images and the GPU restore has
taken it back. criu copies it through its parasite's pipes, one page batch and one process at a time, at
2.2-2.6 GB/s (docs/gpu.md); here each of `threads` threads moves 16 MiB chunks between the process and a
file of its own (a part: a buffered write holds its file's inode lock, so threads writing one file take turns
and the copy ran at one thread's 3.4-3.7 GB/s on the H200), so the copy runs at the speed of memory and of
the file system's page cache. The
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


def part_size(total: int, parts: int, page: int = 4096) -> int:
    """The bytes of each part when `total` bytes are cut into `parts` files (the last may be shorter):
    whole pages, so that every chunk of a part stays page aligned."""
    per = -(-total // max(1, parts))
    return max(page, -(-per // page) * page)


def _chunks(layout: list[Span], part: int) -> list[list[tuple[int, int, int]]]:
    """Per part of `part` bytes: its chunks (address, offset in the part, bytes), none crossing a part's end."""
    out: list[list[tuple[int, int, int]]] = []
    for s in layout:
        o = 0
        while o < s.size:
            at = s.offset + o
            k, within = divmod(at, part)
            n = min(CHUNK, s.size - o, part - within)
            while len(out) <= k:
                out.append([])
            out[k].append((s.start + o, within, n))
            o += n
    return out


def _vm(call: Callable[..., int], pid: int, address: int, buf: ctypes.Array[ctypes.c_char], n: int,
        what: str) -> None:
    local = _IoVec(ctypes.addressof(buf), n)
    remote = _IoVec(address, n)
    done = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != n:
        err = ctypes.get_errno() if done < 0 else 0
        raise OSError(err or 5, f"{what} of pid {pid} at {address:#x}: {done} of {n} bytes"
                      + (f" ({os.strerror(err)})" if err else ""))


def _run(parts: list[list[tuple[int, int, int]]], fds: Sequence[int],
         one: Callable[[ctypes.Array[ctypes.c_char], int, int, int, int], None]) -> None:
    """`one(buffer, fd, address, offset, n)` for every chunk, one thread per part (its own file); the first
    error is raised once every thread stopped."""
    errors: list[BaseException] = []

    def worker(fd: int, work: list[tuple[int, int, int]]) -> None:
        buf = ctypes.create_string_buffer(CHUNK)
        for item in work:
            if errors:
                return
            try:
                one(buf, fd, *item)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors.append(e)
                return
    pool = [threading.Thread(target=worker, args=(fds[k], work), daemon=True) for k, work in enumerate(parts)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _check_parts(layout: list[Span], fds: Sequence[int], part: int) -> list[list[tuple[int, int, int]]]:
    parts = _chunks(layout, part)
    if len(parts) > len(fds):
        raise ValueError(f"{len(parts)} parts of {part} bytes need as many files, {len(fds)} given")
    return parts


def copy_out(pid: int, layout: list[Span], fds: Sequence[int], part: int) -> float:
    """The spans of `pid`'s memory into the files `fds` (byte `offset` of the layout at `offset % part` of
    file `offset // part`), one thread per file. Seconds taken."""
    t0 = time.monotonic()

    def one(buf: ctypes.Array[ctypes.c_char], fd: int, address: int, offset: int, n: int) -> None:
        _vm(_libc.process_vm_readv, pid, address, buf, n, "reading the memory")
        view = memoryview(buf)[:n]
        while view:
            view = view[os.pwrite(fd, view, offset + n - len(view)):]
    _run(_check_parts(layout, fds, part), fds, one)
    return time.monotonic() - t0


def copy_in(pid: int, layout: list[Span], fds: Sequence[int], part: int) -> float:
    """The files' spans back into `pid`'s memory at the same addresses (the layout of copy_out). Seconds
    taken."""
    t0 = time.monotonic()

    def one(buf: ctypes.Array[ctypes.c_char], fd: int, address: int, offset: int, n: int) -> None:
        got = 0
        view = memoryview(buf)
        while got < n:
            k = os.preadv(fd, [view[got:n]], offset + got)
            if k <= 0:
                raise OSError(5, f"the page file ended at {offset + got} of {offset + n}")
            got += k
        _vm(_libc.process_vm_writev, pid, address, buf, n, "writing the memory")
    _run(_check_parts(layout, fds, part), fds, one)
    return time.monotonic() - t0
