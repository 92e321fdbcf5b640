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


@pytest.mark.parametrize("parts", [1, 4])
def test_a_stopped_process_s_ranges_go_out_and_come_back_into_another_process(tmp_path: Path, parts: int) -> None:
    """Ranges of a stopped process (two of them, one not a multiple of the chunk) are written end to end
    into `parts` files, each by a thread of its own; written into a second process's empty mapping at the
    same offsets, its memory then holds exactly what the first one's held."""
    n = 40 * MiB + 3 * PAGE
    src, address, digest = _child(n, fill=True)
    dst, address2, empty = _child(n, fill=False)
    try:
        assert digest != empty
        os.kill(src.pid, signal.SIGSTOP)
        half = (n // 2) // PAGE * PAGE
        layout = process_memory.spans([(address, address + half), (address + half, address + n)])
        part = process_memory.part_size(n, parts, PAGE)
        fds = [os.open(tmp_path / f"copy.{k}.img", os.O_RDWR | os.O_CREAT, 0o600) for k in range(parts)]
        try:
            process_memory.copy_out(src.pid, layout, fds, part)
            assert [os.fstat(fd).st_size for fd in fds] == [min(part, n - k * part) for k in range(parts)]
            moved = process_memory.spans([(address2, address2 + half), (address2 + half, address2 + n)])
            process_memory.copy_in(dst.pid, moved, fds, part)
        finally:
            for fd in fds:
                os.close(fd)
        assert _digest(dst) == digest
    finally:
        for p in (src, dst):
            p.kill()
            p.wait()


def test_parts_are_whole_pages_and_no_chunk_crosses_a_part() -> None:
    layout = process_memory.spans([(0x10000, 0x10000 + 5 * MiB + PAGE), (0x9000000, 0x9000000 + 3 * MiB)])
    part = process_memory.part_size(8 * MiB + PAGE, 3, PAGE)
    assert part % PAGE == 0 and 3 * part >= 8 * MiB + PAGE
    chunks = process_memory._chunks(layout, part)
    assert len(chunks) == 3
    assert sum(n for work in chunks for _, _, n in work) == 8 * MiB + PAGE
    assert all(offset + n <= part for work in chunks for _, offset, n in work)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_rank_s_entries_bring_the_copy_back_and_a_one_file_capture_still_restores(tmp_path: Path,
                                                                                       threads: int) -> None:
    """host_copy's entries name the part files; an entry of a capture made before the parts (one file
    `host-copy-N.img`, no `parts`) is read as one part."""
    n = 40 * MiB + 5 * PAGE
    src, address, digest = _child(n, fill=True)
    dst, address2, _ = _child(n, fill=False)
    old_dst, address3, _ = _child(n, fill=False)
    try:
        os.kill(src.pid, signal.SIGSTOP)
        entries, skip, _ = host_copy.copy_out({src.pid: [(address, address + n)]}, tmp_path, threads)
        assert skip == [(src.pid, address, address + n)]
        (entry,) = entries
        assert len(entry["parts"]) == threads and entry["file"] == entry["parts"][0]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(entry["parts"])
        moved = dict(entry, nspid=host_copy._nspid(dst.pid), ranges=[[address2, address2 + n]])
        host_copy.copy_in([moved], tmp_path, [dst.pid], threads)
        assert _digest(dst) == digest
        # a capture from before the parts: the same bytes in one file, its entry without parts
        whole = b"".join((tmp_path / name).read_bytes() for name in entry["parts"])
        (tmp_path / "host-copy-0.img").write_bytes(whole)
        one_file = {"nspid": host_copy._nspid(old_dst.pid), "file": "host-copy-0.img",
                    "ranges": [[address3, address3 + n]]}
        host_copy.copy_in([one_file], tmp_path, [old_dst.pid], threads)
        assert _digest(old_dst) == digest
    finally:
        for p in (src, dst, old_dst):
            p.kill()
            p.wait()


def test_read_ahead_asks_the_kernel_for_every_part_of_every_entry_and_skips_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While criu restores, each part file (and the one file of a capture from before the parts) is read
    into the page cache by a thread of its own; a file that is not there is left for copy_in to report."""
    advised: list[tuple[str, int, int, int]] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        real_fadvise(fd, offset, length, advice)
    monkeypatch.setattr(host_copy.os, "posix_fadvise", fadvise)
    for name in ("host-copy-0.0.img", "host-copy-0.1.img", "host-copy-1.img"):
        (tmp_path / name).write_bytes(b"x" * PAGE)
    entries = [{"nspid": 5, "file": "host-copy-0.0.img", "parts": ["host-copy-0.0.img", "host-copy-0.1.img"],
                "part_size": PAGE, "ranges": [[0, 2 * PAGE]]},
               {"nspid": 6, "file": "host-copy-1.img", "ranges": [[0, PAGE]]},
               {"nspid": 7, "file": "host-copy-2.0.img", "parts": ["host-copy-2.0.img"], "part_size": PAGE,
                "ranges": [[0, PAGE]]}]
    threads = host_copy.read_ahead(entries, tmp_path)
    assert len(threads) == 4
    for t in threads:
        t.join(5)
    assert sorted(advised) == sorted((str(tmp_path / n), 0, 0, os.POSIX_FADV_WILLNEED)
                                     for n in ("host-copy-0.0.img", "host-copy-0.1.img", "host-copy-1.img"))


def test_a_range_the_process_does_not_have_fails_the_copy_naming_pid_and_address(tmp_path: Path) -> None:
    src, address, _ = _child(4 * MiB, fill=True)
    try:
        fd = os.open(tmp_path / "copy.img", os.O_RDWR | os.O_CREAT, 0o600)
        bogus = process_memory.spans([(PAGE, PAGE * 3)])
        with pytest.raises(OSError, match=f"pid {src.pid} at {PAGE:#x}"):
            process_memory.copy_out(src.pid, bogus, [fd], PAGE * 2)
        os.close(fd)
    finally:
        src.kill()
        src.wait()
