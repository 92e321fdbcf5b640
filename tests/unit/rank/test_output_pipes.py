"""The wait for a frozen tree's stdio pipes to be read empty, on real pipes of a real child process."""
from __future__ import annotations

import pytest

import os
import subprocess
import sys
import threading
import time

from slurmckpt.rank import output_pipes
from slurmckpt.node.launch import Credentials

ME = Credentials(os.getuid(), os.getgid(), (), ())
NOBODY = Credentials(65534, 65534, (), ())


def child_writing_to(stdout, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """A child whose fds 1 and 2 are what it was given; it writes 5 bytes to fd 1 and waits."""
    return subprocess.Popen([sys.executable, "-c", "import os,time; os.write(1, b'hello'); time.sleep(30)"],
                            stdout=stdout, stderr=stderr)


@pytest.mark.system
def test_unread_bytes_in_the_pipe_are_waited_for_until_the_reader_takes_them() -> None:
    r, w = os.pipe()
    child = child_writing_to(w)
    os.close(w)
    try:
        time.sleep(0.5)
        assert output_pipes.wait_drained(ME, [child.pid], limit_s=0.3) is False     # nobody reads yet
        reader = threading.Timer(0.3, lambda: os.read(r, 100))
        reader.start()
        started = time.monotonic()
        assert output_pipes.wait_drained(ME, [child.pid], limit_s=5) is True
        assert time.monotonic() - started >= 0.25          # it waited for the reader, not past it
        reader.join()
    finally:
        child.kill()
        child.wait()
        os.close(r)


def test_a_regular_output_file_and_a_gone_process_need_no_wait(tmp_path) -> None:
    with open(tmp_path / "out", "wb") as f:
        child = child_writing_to(f)
    try:
        assert output_pipes.open_pipes(ME, [child.pid]) == []
        assert output_pipes.wait_drained(ME, [child.pid, 2**22 + 7], limit_s=0.1) is True
    finally:
        child.kill()
        child.wait()


@pytest.mark.system
def test_the_pipe_is_opened_as_the_user_and_one_the_user_cannot_reach_is_not_waited_for() -> None:
    """Root's own process is out of another user's reach: nothing is opened for that user, no wait."""
    r, w = os.pipe()
    child = child_writing_to(w, stderr=w)
    os.close(w)
    try:
        time.sleep(0.5)
        fds = output_pipes.open_pipes(ME, [child.pid])
        assert len(fds) == 1                                  # fds 1 and 2: one pipe, opened once
        assert output_pipes.unread_bytes(fds[0]) == 5
        os.close(fds[0])
        assert output_pipes.open_pipes(NOBODY, [child.pid]) == []
    finally:
        child.kill()
        child.wait()
        os.close(r)
