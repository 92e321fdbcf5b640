"""The GPU checkpoint's host copy moved by slurmckpt's threads (rank/host_copy.py, node/process_memory.py):
which ranges are the driver's new memory, and the copy out of a stopped process and back into another."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurmckpt.node import process_memory
from slurmckpt.rank import host_copy

MiB = 1 << 20
PAGE = host_copy.PAGE


def test_the_new_memory_is_what_appeared_or_grew_and_nothing_small_counts() -> None:
    """A mapping that appeared, and the part of an old one that grew, are the host copy; what was there
    before is not; a process whose new memory stays under MIN_BYTES is left to criu."""
    base = 0x7F0000000000
    before = {1: [(base, base + 4 * MiB)], 2: [(base, base + MiB)]}
    after = {1: [(base, base + 4 * MiB + 128 * MiB), (base + 512 * MiB, base + 576 * MiB)],
             2: [(base, base + MiB), (base + 8 * MiB, base + 9 * MiB)]}
    assert host_copy.grown(before, after) == {1: [(base + 4 * MiB, base + 132 * MiB),
                                                  (base + 512 * MiB, base + 576 * MiB)]}
    assert host_copy.grown(after, after) == {}


CHILD = r"""
import ctypes, hashlib, mmap, sys, time
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if sys.argv[2] == "fill":
    for off in range(0, n, 4096):
        m[off:off + 4096] = hashlib.sha256(str(off).encode()).digest() * 128
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), hashlib.sha256(m[:]).hexdigest(), flush=True)
for line in sys.stdin:
    print(hashlib.sha256(m[:]).hexdigest(), flush=True)
"""


def _child(n: int, fill: bool) -> tuple[subprocess.Popen[str], int, str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(n), "fill" if fill else "empty"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    address, digest = p.stdout.readline().split()
    return p, int(address), digest


def _digest(p: subprocess.Popen[str]) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("?\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_stopped_process_s_ranges_go_out_and_come_back_into_another_process(tmp_path: Path, threads: int) -> None:
    """Ranges of a stopped process (two of them, one not a multiple of the chunk) are written end to end
    into one file; written into a second process's empty mapping at the same offsets, its memory then
    holds exactly what the first one's held."""
    n = 40 * MiB + 3 * PAGE
    src, address, digest = _child(n, fill=True)
    dst, address2, empty = _child(n, fill=False)
    try:
        assert digest != empty
        os.kill(src.pid, signal.SIGSTOP)
        half = (n // 2) // PAGE * PAGE
        layout = process_memory.spans([(address, address + half), (address + half, address + n)])
        fd = os.open(tmp_path / "copy.img", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            process_memory.copy_out(src.pid, layout, fd, threads)
            assert os.fstat(fd).st_size == n
            moved = process_memory.spans([(address2, address2 + half), (address2 + half, address2 + n)])
            process_memory.copy_in(dst.pid, moved, fd, threads)
        finally:
            os.close(fd)
        assert _digest(dst) == digest
    finally:
        for p in (src, dst):
            p.kill()
            p.wait()


def test_a_range_the_process_does_not_have_fails_the_copy_naming_pid_and_address(tmp_path: Path) -> None:
    src, address, _ = _child(4 * MiB, fill=True)
    try:
        fd = os.open(tmp_path / "copy.img", os.O_RDWR | os.O_CREAT, 0o600)
        bogus = process_memory.spans([(PAGE, PAGE * 3)])
        with pytest.raises(OSError, match=f"pid {src.pid} at {PAGE:#x}"):
            process_memory.copy_out(src.pid, bogus, fd, 2)
        os.close(fd)
    finally:
        src.kill()
        src.wait()
