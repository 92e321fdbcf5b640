"""A process in the middle of a PMI exchange, for the tests of the capture's PMI check (pmi.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from slurmckpt.node import procfs

READ = {"x86_64": 0, "aarch64": 63}[os.uname().machine]

# A PMI client's barrier: send the request on the socket at fd argv[1], then block reading the answer.
CLIENT = "import os, sys; fd = int(sys.argv[1]); os.write(fd, b'cmd=barrier_in\\n'); os.read(fd, 64)"


def waiting_client(sock: socket.socket) -> subprocess.Popen:
    """A process holding `sock` (same fd number) that has sent a request and is blocked reading the answer."""
    fd = sock.fileno()
    child = subprocess.Popen([sys.executable, "-c", CLIENT, str(fd)], pass_fds=(fd,))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # in read() on that fd: a thread merely preempted in another syscall on it is not there yet
        if any(blocked is not None and blocked[0] == READ and blocked[1][0] == fd
               for blocked in (procfs.blocked_syscall(child.pid, t) for t in procfs.threads(child.pid))):
            return child
        time.sleep(0.02)
    child.kill()
    raise AssertionError("the client never blocked reading its PMI socket")
