"""The GPU host copy moved by slurmckpt's threads through our real criu (patch 0008), on the CPU: a process
whose new anonymous memory stands for a GPU checkpoint's host copy is captured with that memory copied out
by host_copy.py (before criu's dump, as a final capture does, or beside it, as a periodic one does) and
skipped by criu, restored stopped, given its memory back, and runs on with exactly what it held (docs/gpu.md,
"The host copy, copied in parallel"). On the GPU machine the same stages carry the driver's real host copy
(tests/gpu)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slurmckpt.config import Config
from slurmckpt.criu.driver import CriuDriver
from slurmckpt.node import proctree
from slurmckpt.rank import host_copy

WORK = Path("/var/lib/slurmckpt-test-host-copy")
MiB = 1 << 20

HOLDER = r"""
import ctypes, hashlib, mmap, os, signal, sys, time
state = {}
def grow(*_):           # what the driver's checkpoint does: new anonymous memory, filled
    n = int(sys.argv[1])
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, n, 4096):
        m[off:off + 4096] = hashlib.sha256(str(off).encode()).digest() * 128
    state["m"] = m
    print("grown", hashlib.sha256(m[:]).hexdigest(), flush=True)
signal.signal(signal.SIGUSR1, grow)
signal.signal(signal.SIGUSR2, lambda *_: print("holds", hashlib.sha256(state["m"][:]).hexdigest(), flush=True))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _wait_line(log: Path, prefix: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no {prefix!r} line in {log}: {log.read_text()[-1000:]}")


@pytest.mark.parametrize("beside", [False, True])
def test_criu_skips_the_pages_slurmckpt_copied_and_the_restore_gets_them_back(beside: bool) -> None:
    """`beside`: as a periodic capture does it, the copy runs while criu dumps (criu seizes the process and
    runs its parasite in it while the copy's threads read its memory)."""
    work = WORK
    subprocess.run(["rm", "-rf", str(work)], check=True)
    (work / "images").mkdir(parents=True)
    log = work / "holder.log"
    with open(log, "w") as out:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(256 * MiB)], stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    _wait_line(log, "ready")
    before = host_copy.anonymous_ranges([holder.pid])
    os.kill(holder.pid, signal.SIGUSR1)
    digest = _wait_line(log, "grown").split()[1]
    copies = host_copy.grown(before, host_copy.anonymous_ranges([holder.pid]))
    assert sum(e - s for s, e in copies[holder.pid]) >= 256 * MiB, copies
    os.kill(holder.pid, signal.SIGSTOP)
    criu = CriuDriver(Config.load().criu_path)
    skip = host_copy.skip_list(copies)
    with ThreadPoolExecutor(1) as pool:
        copying = pool.submit(host_copy.copy_out, copies, work / "images", 4)
        if not beside:
            copying.result()
        # beside: the process must outlive the copy, as a periodic capture's tree does (a final one's ends
        # with criu's dump, after its copy)
        criu.dump(holder.pid, work / "images", leave_running=beside, freezer=None, skip_pages=skip)
        entries, copied_skip, _ = copying.result()
    assert copied_skip == skip
    if beside:
        holder.kill()
    holder.wait(timeout=30)
    pages = sum(p.stat().st_size for p in (work / "images").glob("pages-*.img"))
    assert pages < 64 * MiB, f"criu still dumped the skipped pages ({pages} bytes of pages)"
    host_copy.read_ahead(entries, work / "images")     # as the restore does, beside criu's own reads
    pid = criu.restore(work / "images", [], freezer=None, leave_stopped=True)
    try:
        host_copy.copy_in(entries, work / "images", proctree.descendants(pid), 4)
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGUSR2)
        assert _wait_line(log, "holds").split()[1] == digest
    finally:
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["rm", "-rf", str(work)], check=True)
