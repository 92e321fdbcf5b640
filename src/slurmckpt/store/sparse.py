"""Copies of the files a capture takes besides criu's images (the task's output files, /dev/shm files) that
keep their holes, counted by the bytes they hold (docs/storage.md, "What a capture copies").

A file's logical size costs its user nothing (`truncate -s 1T` makes a 1 TiB file of one block): a copy up to
that size would fill staging and the store with zeros. So only the file's data ranges are copied
(SEEK_DATA/SEEK_HOLE), packed one after the other into the copy, and their (offset, length) list is kept
with it; the write-back puts each range at its offset and the holes stay holes. Every range is charged to
the capture's budget before a byte of it is copied (`charge` raises to refuse). A file system that does not
report holes gives one range, the whole file: it is then counted at its full size.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable, Iterator

BLOCK = 8 << 20
MAX_RANGES = 1024     # more, and each further range is merged with the one before (its gap copied, charged)


def allocated(st: os.stat_result) -> int:
    """Bytes a file holds on its file system, at most its size (what a copy of its data ranges writes)."""
    return min(st.st_blocks * 512, st.st_size)


def _ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:        # only a hole after pos
                return
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, size - pos        # no hole reporting here: all of it is data
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end - start
        pos = end


def copy_data(src: int, dst: Path, size: int, charge: Callable[[int], None], name: str) -> list[list[int]]:
    """Copy the data ranges of `src` below `size` into the new file `dst`, packed; return them as
    [[offset, length], ...]. `charge(n)` is called before n bytes are copied (it raises to refuse).
    OSError(EIO) naming `name` when the file shrank meanwhile."""
    ranges: list[list[int]] = []
    for start, length in _ranges(src, size):
        if len(ranges) >= MAX_RANGES:
            last = ranges[-1]
            charge(start + length - (last[0] + last[1]))
            last[1] = start + length - last[0]
        else:
            charge(length)
            ranges.append([start, length])
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        for start, length in ranges:
            done = 0
            while done < length:
                block = os.pread(src, min(BLOCK, length - done), start + done)
                if not block:
                    raise OSError(errno.EIO, f"{name} shrank during the capture")
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
                done += len(block)
    finally:
        os.close(fd)
    return ranges


def write_back(dst: int, src: int, ranges: list[list[int]] | None, size: int) -> None:
    """Make `dst` hold `size` bytes: the packed data of `src` (from its current position) at `ranges`,
    holes between. None: `src` holds all `size` bytes (a copy made before ranges were kept). Works on an
    O_APPEND fd too (each range is written at the end, after a truncate that extends the file to its
    offset)."""
    os.ftruncate(dst, 0)
    for start, length in ranges if ranges is not None else [[0, size]]:
        os.ftruncate(dst, start)
        os.lseek(dst, start, os.SEEK_SET)
        left = length
        while left:
            block = os.read(src, min(BLOCK, left))
            if not block:
                raise OSError(errno.EIO, "the saved copy is shorter than its ranges")
            view = memoryview(block)
            while view:
                view = view[os.write(dst, view):]
            left -= len(block)
    os.ftruncate(dst, size)
    os.lseek(dst, size, os.SEEK_SET)
