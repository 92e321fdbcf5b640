"""Actions on the user's paths as the user (asuser.py): non-blocking, bounded in time."""
from __future__ import annotations

import os
import time

import pytest

from slurmckpt.node import asuser
from slurmckpt.errors import PermissionDenied
from slurmckpt.node.launch import Credentials

ME = Credentials(os.getuid(), os.getgid(), tuple(os.getgroups()), ())


@pytest.mark.system
def test_an_action_as_the_user_that_blocks_is_killed_at_its_time_limit() -> None:
    """A path through a FUSE mount the user serves can block an open or a read for as long as the user
    likes: the child doing it as the user is killed at its time limit, the caller gets PermissionDenied."""
    start = time.monotonic()
    with pytest.raises(PermissionDenied, match="open: no answer within 0s"):
        asuser.run_as_user(ME, lambda: time.sleep(30), "open", timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert asuser.call_as_user(ME, lambda: b"facts", "read") == b"facts"
    with pytest.raises(PermissionDenied, match="read: boom"):
        asuser.call_as_user(ME, lambda: (_ for _ in ()).throw(OSError(5, "boom")), "read")


@pytest.mark.system
def test_opening_a_fifo_as_the_user_never_waits_for_its_other_end(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(PermissionDenied, match="No such device or address"):
        asuser.open_as_user(ME, str(fifo), os.O_WRONLY)
    os.close(asuser.open_as_user(ME, str(fifo), os.O_RDONLY))
    assert time.monotonic() - start < 5
