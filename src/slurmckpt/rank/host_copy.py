"""The GPU checkpoint's host copy, moved by slurmckpt in parallel instead of by criu (docs/gpu.md, "The host
copy, copied in parallel").

cuCheckpointProcessCheckpoint copies each CUDA process's device memory into new anonymous memory of that
process. At 8-32 GiB per GPU that copy is nearly all of the image, and criu dumps it through its parasite at
2.2-2.6 GB/s while the job is stopped. So:

- PREPARE's gpu-checkpoint notes each process's private anonymous writable ranges before and after the
  driver's copy (`ranges_before`, `grown`): what appeared is the host copy;
- CAPTURE, on the frozen tree before criu dumps: each process's new ranges go into the rank's images, cut
  into `threads` parts `host-copy-N.K.img` each written by a thread of its own (node/process_memory.py;
  one file would make the threads take turns at its inode lock), and criu dumps them as untouched pages
  (`--skip-pages`, our criu patch 0008): its image holds their mappings, not their bytes;
- RESTORE, once criu has brought the tree back stopped: the files are written back into the restored
  processes (found by their pid inside the tree's PID namespace, which the restore keeps) before the GPU
  restore reads them. While criu restores, the files are read ahead into the page cache (`read_ahead`), so
  the disk reads them beside criu's own images instead of after them.

Each part is one more file of the rank's images: persisted, checksummed and unpacked like criu's own.
`threads` 0 leaves the copy to criu, as before.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from slurmckpt.errors import CaptureError, RestoreError
from slurmckpt.node import procfs, process_memory

log = logging.getLogger("slurmckpt.host_copy")

PAGE = os.sysconf("SC_PAGE_SIZE")
MIN_BYTES = 64 << 20        # below this criu's own copy costs less than the threads' start


def anonymous_ranges(pids: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Each process's private anonymous writable mappings (no file, not the heap or stack)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for pid in pids:
        try:
            maps = procfs.maps(pid)
        except OSError:
            continue
        out[pid] = [(int(a, 16), int(b, 16)) for parts in maps if len(parts) == 5 and parts[1].startswith("rw")
                    and parts[1][3] == "p" for a, b in [parts[0].split("-")]]
    return out


def grown(before: dict[int, list[tuple[int, int]]], after: dict[int, list[tuple[int, int]]]
          ) -> dict[int, list[tuple[int, int]]]:
    """The addresses each process has in `after` and not in `before` (its new anonymous memory), as
    page-aligned ranges, for processes whose new memory reaches MIN_BYTES."""
    out = {}
    for pid, ranges in after.items():
        new = _subtract(sorted(ranges), sorted(before.get(pid, [])))
        if sum(e - s for s, e in new) >= MIN_BYTES:
            out[pid] = new
    return out


def _subtract(ranges: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for start, end in ranges:
        pieces = [(start, end)]
        for ts, te in taken:
            pieces = [p for s, e in pieces for p in ((s, min(e, ts)), (max(s, te), e)) if p[0] < p[1]]
        out += pieces
    merged: list[tuple[int, int]] = []
    for s, e in sorted(out):
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return [(s, e) for s, e in merged if s % PAGE == 0 and e % PAGE == 0]


def copy_out(copies: dict[int, list[tuple[int, int]]], images: Path, threads: int,
             **context: object) -> tuple[list[dict[str, Any]], list[tuple[int, int, int]], float]:
    """Each process's host copy into images/host-copy-N.K.img, K < `threads`. Returns the rank record's
    entries, criu's --skip-pages list (pid, start, end) and the seconds the copy took."""
    entries, seconds = [], 0.0
    for i, (pid, ranges) in enumerate(sorted(copies.items())):
        layout = process_memory.spans(ranges)
        total = sum(s.size for s in layout)
        count = max(1, min(threads, -(-total // process_memory.CHUNK)))
        part = process_memory.part_size(total, count, PAGE)
        names = [f"host-copy-{i}.{k}.img" for k in range(-(-total // part) if total else 1)]
        fds: list[int] = []
        try:
            for k, name in enumerate(names):
                fds.append(os.open(images / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                os.ftruncate(fds[-1], min(part, total - k * part))
            seconds += process_memory.copy_out(pid, layout, fds, part)
        except OSError as e:
            raise CaptureError(f"copying the GPU host copy of pid {pid}: {e}", **context) from e
        finally:
            for fd in fds:
                os.close(fd)
        entries.append({"nspid": _nspid(pid), "file": names[0], "parts": names, "part_size": part,
                        "ranges": [list(r) for r in ranges]})
    return entries, skip_list(copies), seconds


def skip_list(copies: dict[int, list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """criu's --skip-pages list (pid, start, end) for these copies: known before the copy runs, so criu's
    dump can run beside it (rank/capture.py)."""
    return [(pid, s, e) for pid, ranges in sorted(copies.items()) for s, e in ranges]


def _parts(entry: dict[str, Any]) -> tuple[list[str], int]:
    """The entry's files and the bytes of each: a capture from before the parts wrote one file."""
    if "parts" not in entry:
        return [entry["file"]], max(1, sum(int(t) - int(s) for s, t in entry["ranges"]))
    return [str(n) for n in entry["parts"]], int(entry["part_size"])


def read_ahead(entries: list[dict[str, Any]], images: Path) -> list[threading.Thread]:
    """Starts reading every part file into the page cache, a thread each, and returns at once: copy_in then
    finds their pages there. A part the kernel cannot read ahead (or a file that is missing) is left to
    copy_in, which reads it and reports what is wrong."""
    def one(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError as e:
            log.debug("reading %s ahead: %s", path, e)
        finally:
            os.close(fd)
    threads = [threading.Thread(target=one, args=(images / name,), name="host-copy-ahead", daemon=True)
               for e in entries for name in _parts(e)[0]]
    for t in threads:
        t.start()
    return threads


def copy_in(entries: list[dict[str, Any]], images: Path, pids: list[int], threads: int,
            **context: object) -> float:
    """The saved host copies back into the restored processes `pids` (matched by their pid inside the
    tree's PID namespace), a thread per part file. Seconds taken."""
    by_nspid: dict[int, int] = {}
    for pid in pids:
        try:
            by_nspid[_nspid(pid)] = pid
        except (OSError, KeyError, ValueError):
            continue
    seconds = 0.0
    for e in entries:
        target = by_nspid.get(e["nspid"])
        if target is None:
            raise RestoreError(f"no restored process has pid {e['nspid']} in the tree's namespace for "
                               f"{e['file']}", **context)
        names, part = _parts(e)
        fds: list[int] = []
        try:
            for name in names:
                fds.append(os.open(images / name, os.O_RDONLY | os.O_CLOEXEC))
            seconds += process_memory.copy_in(target, process_memory.spans([(int(s), int(t)) for s, t in e["ranges"]]),
                                              fds, part)
        except (OSError, ValueError) as err:
            raise RestoreError(f"writing the GPU host copy back into pid {target}: {err}", **context) from err
        finally:
            for fd in fds:
                os.close(fd)
    return seconds


def _nspid(pid: int) -> int:
    return int(procfs.status(pid)["NSpid"][-1])
