"""Small real file systems for the store's failure tests (root only: they mount). A size-limited tmpfs gives
real ENOSPC at a chosen byte count; `leave_free` fills it up to that point with one preallocated file."""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PAGE = 4096


def require_root() -> None:
    if os.geteuid() != 0:
        raise AssertionError("these tests mount small file systems and must run as root (CI does)")


@contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `where` (mode 0700), unmounted afterwards."""
    require_root()
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "slurmckpt-test", str(where)],
                   check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def leave_free(fs: Path, nbytes: int) -> Path:
    """Fill `fs` so that `nbytes` (rounded down to pages) stay free; returns the filler to remove."""
    filler = fs / ".filler"
    filler.unlink(missing_ok=True)
    fill = free(fs) - nbytes
    if fill > 0:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, fill)
        finally:
            os.close(fd)
    return filler
