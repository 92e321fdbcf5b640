"""Occupy given host pids (root: /proc/sys/kernel/ns_last_pid), so that a restore which needed them would
fail: the proof that a tree in its own PID namespace is restored whatever holds its old host pids."""
from __future__ import annotations

import subprocess
from pathlib import Path

LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def take(pid: int, tries: int = 200) -> subprocess.Popen | None:
    """A `sleep` running with host pid `pid`, or None (busy, or another fork got it first each time)."""
    for _ in range(tries):
        if Path(f"/proc/{pid}").exists():
            return None
        LAST_PID.write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "900"], start_new_session=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None
