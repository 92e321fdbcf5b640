"""node/stopped.py on the real kernel: one thread of a SIGSTOPped process runs alone (ptrace), the way the CUDA
driver's restore thread is run for the GPU restore while the rest of the tree stays stopped, then goes back
into its process's stop; let_go continues the process. The GPU side is proven on the GPU machine (docs/gpu.md,
"The GPU restore runs while the tree is stopped"). Needs root or the right to ptrace one's own children."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmckpt.node import procfs, stopped

# the worker thread counts into a file; the main thread waits in pause() without Python's lock, so the worker
# alone can run Python code. Each count overwrites a fixed-width field in place: a file truncated and then
# written would stay empty for good when the stop came between the two (seen in CI)
PROGRAM = """
import ctypes, os, sys, threading, time
def count():
    open(sys.argv[1] + '.tid', 'w').write(str(threading.get_native_id()))
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    n = 0
    while True:
        n += 1
        os.pwrite(fd, b'%012d' % n, 0)
        time.sleep(0.005)
threading.Thread(target=count, daemon=True).start()
ctypes.CDLL(None).pause()
"""


def _state(tid: int) -> str:
    return procfs.stat(tid).state


def _count(path: Path) -> int:
    for _ in range(50):
        text = path.read_text()
        if text:
            return int(text)
        time.sleep(0.005)
    raise AssertionError(f"{path} stays empty")


def _wait(what, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def program(tmp_path: Path):
    counter = tmp_path / "count"
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(counter)])
    try:
        _wait(lambda: (tmp_path / "count.tid").exists() and (tmp_path / "count.tid").read_text() and
              counter.exists() and counter.read_text())
        yield p, int((tmp_path / "count.tid").read_text()), counter
    finally:
        p.kill()
        p.wait()


@pytest.mark.system
def test_one_thread_of_a_stopped_process_runs_alone_and_goes_back_into_the_stop(program):
    p, worker, counter = program
    os.kill(p.pid, signal.SIGSTOP)
    _wait(lambda: _state(p.pid) == "T" and _state(worker) == "T")
    assert stopped.stopped([p.pid]) == {p.pid}
    before = _count(counter)
    time.sleep(0.1)
    assert _count(counter) == before, "the process runs though stopped"

    with stopped.running_alone(worker):
        time.sleep(0.3)
        assert _count(counter) > before, "the thread run alone made no progress"
        assert _state(p.pid) == "T", "another thread of the process runs too"
    after = _count(counter)
    _wait(lambda: _state(worker) == "T")
    time.sleep(0.1)
    assert _count(counter) == after, "the thread runs on after running_alone"
    assert _state(p.pid) == "T"

    stopped.let_go([p.pid, 999_999_999])        # a pid that is gone is skipped
    _wait(lambda: _count(counter) > after)
    assert _state(p.pid) != "T"


def test_a_thread_that_is_not_there_is_an_error_not_a_hang():
    with pytest.raises(stopped.PtraceError):
        with stopped.running_alone(999_999_999):
            pass
