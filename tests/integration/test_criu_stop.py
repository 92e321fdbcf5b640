"""The real criu past its timeout (CRIU with our patches, no Slurm needed): the agent's driver stops it with
SIGALRM, and criu leaves through its own error path within the grace: the dumped process is released (no
tracer, not stopped) and criu says the dump failed; nothing needed a SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurmckpt.config import Config
from slurmckpt.criu.driver import CriuDriver
from slurmckpt.errors import CriuInterrupted


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)


def test_real_criu_past_its_timeout_exits_itself_on_sigalrm_and_releases_the_tree(tmp_path: Path) -> None:
    """An action script holds criu at post-dump (the tree still seized) past the driver's 2 s limit."""
    hook_pid = tmp_path / "hook.pid"
    hook = tmp_path / "hold.sh"
    hook.write_text(f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\necho $$ > {hook_pid}\n'
                    "exec sleep 60\n")
    hook.chmod(0o755)
    images = tmp_path / "images"
    images.mkdir()
    tree = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    criu = CriuDriver(Config.load().criu_path, ("--action-script", str(hook)), timeout_s=2.0)
    try:
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(CriuInterrupted) as e:
            criu.dump(tree.pid, images, leave_running=True, freezer=None)
        elapsed = time.monotonic() - start
        assert "did not finish within 2s; stopped with SIGALRM, it exited" in str(e.value), str(e.value)
        assert elapsed < 2.0 + criu.stop_grace_s, f"{elapsed:.1f}s: criu was not stopped by SIGALRM"
        assert "Dumping FAILED" in (images / "dump.log").read_text()
        status = _status(tree.pid)
        assert status["TracerPid"].strip() == "0" and status["State"][0] in "SR", status
    finally:
        tree.kill()
        tree.wait()
        if hook_pid.exists():
            try:
                os.kill(int(hook_pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
