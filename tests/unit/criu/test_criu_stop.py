"""criu past its timeout, against fake criu binaries: it is stopped with the signal CRIU's own dump handles
(SIGALRM: its error path cures the parasite), given a grace to exit, and only then killed; either way, and
when a signal ended criu, the error is CriuInterrupted (the caller then trusts nothing criu left)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurmckpt.criu.driver import STOP_SIGNAL, CriuDriver
from slurmckpt.errors import CriuError, CriuInterrupted


def fake(tmp_path: Path, body: str) -> CriuDriver:
    """A criu that records the signals it gets in tmp_path/signals and runs `body` (sh)."""
    binary = tmp_path / "criu"
    binary.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\n{body}\n")
    binary.chmod(0o755)
    return CriuDriver(binary=str(binary), timeout_s=0.5, stop_grace_s=2.0)


def gone(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return False
    except ProcessLookupError:
        return True


LOOP = "while :; do sleep 0.05; done"


def test_criu_past_its_timeout_gets_its_own_stop_signal_and_cleans_up(tmp_path: Path) -> None:
    """A criu that, like CRIU's dump, leaves through its error path on SIGALRM (and would die of SIGTERM at
    once): it gets SIGALRM, never SIGTERM or SIGKILL, and its cleanup runs."""
    criu = fake(tmp_path, f"trap 'echo TERM >> {tmp_path}/signals; exit 9' TERM\n"
                          f"trap 'echo ALRM >> {tmp_path}/signals; echo cured > {tmp_path}/cleanup; exit 1' ALRM\n"
                          + LOOP)
    start = time.monotonic()
    with pytest.raises(CriuInterrupted) as e:
        criu.dump(1, tmp_path, leave_running=True, freezer=None)
    assert time.monotonic() - start < 2.0, "waited out the grace: the stop signal did not end it"
    assert (tmp_path / "signals").read_text() == f"{STOP_SIGNAL.name[3:]}\n"
    assert (tmp_path / "cleanup").read_text() == "cured\n"
    assert "did not finish within 0.5s; stopped with SIGALRM, it exited (1)" in str(e.value)
    assert gone(tmp_path / "pid")


def test_criu_that_does_not_stop_is_killed_after_the_grace(tmp_path: Path) -> None:
    criu = fake(tmp_path, f"trap 'echo ALRM >> {tmp_path}/signals' ALRM\n" + LOOP)
    start = time.monotonic()
    with pytest.raises(CriuInterrupted) as e:
        criu.restore(tmp_path, [], freezer=None)
    elapsed = time.monotonic() - start
    assert 2.4 <= elapsed < 5, f"killed after {elapsed:.1f}s, want the 0.5s timeout + the 2s grace"
    assert (tmp_path / "signals").read_text().startswith("ALRM")
    assert "did not exit within 2s of SIGALRM and was killed" in str(e.value)
    assert gone(tmp_path / "pid")


def test_criu_ended_by_a_signal_is_interrupted_and_a_plain_failure_is_not(tmp_path: Path) -> None:
    with pytest.raises(CriuInterrupted, match="criu dump was killed by signal 9"):
        fake(tmp_path, "kill -KILL $$").dump(1, tmp_path, leave_running=True, freezer=None)
    with pytest.raises(CriuError) as e:
        fake(tmp_path, "echo 'Error (criu/x.c:1): nope' >&2; exit 1").dump(1, tmp_path, leave_running=True,
                                                                        freezer=None)
    assert not isinstance(e.value, CriuInterrupted) and "failed with exit code 1" in str(e.value)
    assert "nope" in e.value.log_tail


def test_an_ignored_stop_signal_is_not_inherited_by_criu(tmp_path: Path) -> None:
    """The agent's own dispositions never reach criu: an ignored SIGALRM would make the stop a kill."""
    import signal
    criu = fake(tmp_path, LOOP)
    previous = signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    try:
        start = time.monotonic()
        with pytest.raises(CriuInterrupted, match="stopped with SIGALRM"):
            criu.dump(1, tmp_path, leave_running=True, freezer=None)
        assert time.monotonic() - start < 2.0
    finally:
        signal.signal(STOP_SIGNAL, previous)
