"""A process holding an io_uring instance (which criu cannot checkpoint) is found and named before anything is
frozen; what PyTorch's rendezvous would make one is kept from making it (task/defaults.py)."""
from __future__ import annotations

import subprocess
import sys
import time

from slurmckpt.node import proctree

MAKES_A_RING = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_ubyte * 120)()
fd = libc.syscall(425, 4, params)            # io_uring_setup(4 entries)
print("ring" if fd >= 0 else f"no ring {ctypes.get_errno()}", flush=True)
time.sleep(30)
"""


def _child(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p


def test_a_process_holding_an_io_uring_is_named_with_its_pid_and_executable():
    ring, plain = _child(MAKES_A_RING), _child("import time; print('plain', flush=True); time.sleep(30)")
    try:
        assert ring.stdout.readline().strip() == "ring" and plain.stdout.readline().strip() == "plain"
        found = proctree.io_uring_holders([plain.pid, ring.pid])
        assert len(found) == 1 and found[0].startswith(f"pid {ring.pid} (python") and "holds an io_uring" in found[0]
        assert sys.executable.split("/")[-1].split(".")[0] in found[0]          # the executable is named
        assert proctree.io_uring_holders([plain.pid]) == []
    finally:
        for p in (ring, plain):
            p.kill()
            p.wait()


def test_a_gone_process_is_not_reported():
    p = _child("print('x', flush=True)")
    p.wait()
    time.sleep(0.1)
    assert proctree.io_uring_holders([p.pid]) == []
