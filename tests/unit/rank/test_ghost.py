"""Deleted-but-open files: found in a live process through /proc, sized into criu's --ghost-limit, refused
above ghost_limit_max before anything is frozen (docs/mpi.md)."""
from __future__ import annotations

import mmap
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from slurmckpt.rank import ghost
from slurmckpt.config import Config
from slurmckpt.errors import CaptureError, ConfigError
from slurmckpt.node.proctree import DeletedFile, deleted_files, relinked_files

MiB = 1 << 20


@contextmanager
def deleted(tmp_path: Path, name: str, size: int, mapped: bool, keep_fd: bool):
    """A file of `size` bytes this process holds (mapped shared and/or open) after unlinking it."""
    path = tmp_path / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED) if mapped else None
    path.unlink()
    if not keep_fd:
        os.close(fd)
    try:
        yield str(path)
    finally:
        if m is not None:
            m.close()
        if keep_fd:
            os.close(fd)


def test_deleted_files_open_or_mapped_are_found_once_each_with_their_size(tmp_path: Path) -> None:
    """An fd-only file, a mapping-only file and one both open and mapped: each found once, biggest first,
    with the size of the inode; a memfd (criu's own image, no ghost file) is not listed."""
    memfd = os.memfd_create("not-a-ghost")
    os.ftruncate(memfd, 8 * MiB)
    try:
        with deleted(tmp_path, "fd-only", 2 * MiB, mapped=False, keep_fd=True) as a, \
                deleted(tmp_path, "map-only", 3 * MiB, mapped=True, keep_fd=False) as b, \
                deleted(tmp_path, "both", 4 * MiB, mapped=True, keep_fd=True) as c:
            found = [f for f in deleted_files([os.getpid()]) if f.path.startswith(str(tmp_path))]
    finally:
        os.close(memfd)
    assert [(f.path, f.size) for f in found] == [(c, 4 * MiB), (b, 3 * MiB), (a, 2 * MiB)]
    assert {f.path: f.how for f in found}[a] == "open"      # (Python's mmap keeps an fd of its own)


def test_a_file_held_by_a_removed_name_that_keeps_another_is_told_from_a_ghost(tmp_path: Path) -> None:
    """A file opened by a name that was then removed while a second name remains (nlink 1) is what criu
    dumps only with a link remap: relinked_files finds it (not deleted_files), unless it is on the file
    system given as the exception (/dev/shm's, which shm_files.py saves itself)."""
    (tmp_path / "a").write_text("x")
    os.link(tmp_path / "a", tmp_path / "keep")
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    os.unlink(tmp_path / "a")
    try:
        with deleted(tmp_path, "ghost", MiB, mapped=False, keep_fd=True) as g:
            found = [f for f in relinked_files([os.getpid()], except_dev=-1) if f.path.startswith(str(tmp_path))]
            ghosts = [f.path for f in deleted_files([os.getpid()]) if f.path.startswith(str(tmp_path))]
            elsewhere = [f for f in relinked_files([os.getpid()], except_dev=os.stat(tmp_path).st_dev)
                         if f.path.startswith(str(tmp_path))]
    finally:
        os.close(fd)
    assert [(f.path, f.how) for f in found] == [(str(tmp_path / "a"), "open")]
    assert ghosts == [g] and elsewhere == []


def test_limit_is_the_biggest_file_never_below_criu_default() -> None:
    files = [DeletedFile("/dev/shm/a", 4 * MiB, 1, "mapped"), DeletedFile("/tmp/b", 3 * MiB, 1, "open")]
    assert ghost.limit_for(files, 256 * MiB) == 4 * MiB
    assert ghost.limit_for([DeletedFile("/tmp/c", 10, 1, "open")], 256 * MiB) == ghost.CRIU_DEFAULT
    assert ghost.limit_for([], 256 * MiB) == ghost.CRIU_DEFAULT


def test_above_the_cap_is_refused_naming_file_size_and_key() -> None:
    files = [DeletedFile("/dev/shm/big", 200 * MiB, 42, "mapped"), DeletedFile("/tmp/b", 100 * MiB, 43, "open")]
    with pytest.raises(CaptureError) as e:
        ghost.limit_for(files, 256 * MiB, rank=0)
    text = str(e.value)
    assert "/dev/shm/big (200.0 MiB, mapped by pid 42)" in text and "300.0 MiB" in text
    assert "ghost_limit_max (256.0 MiB)" in text and "rank=0" in text


def test_ghost_limit_max_takes_units_and_names_the_key_when_bad() -> None:
    assert Config().ghost_limit_max == 256 * MiB
    assert Config.from_mapping({"ghost_limit_max": "64MiB"}).ghost_limit_max == 64 * MiB
    assert Config.from_mapping({"ghost_limit_max": "1.5 GiB"}).ghost_limit_max == 3 * 512 * MiB
    assert Config.from_mapping({"ghost_limit_max": 4096}).ghost_limit_max == 4096
    for bad in ("lots", "-1MiB", "12 parsecs"):
        with pytest.raises(ConfigError, match="'ghost_limit_max'"):
            Config.from_mapping({"ghost_limit_max": bad})
