"""For the tests that run the real criu on a process of their own: waiting for the process's marker file,
and killing what a test started or restored."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def wait_for_marker(marker: Path, timeout_s: float = 5.0) -> str:
    """The marker file's text once the process wrote it ("" if it never did)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.02)
    return marker.read_text() if marker.exists() else ""


def kill_all(process: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL to every pid (the started process, and any restored one), then reap the started one."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=10)
