"""The PMI connection of a rank that `srun --mpi=pmi2` started (MPICH's PMI-1/PMI-2 client, docs/mpi.md).

Slurm's mpi/pmi2 plugin gives every task one end of a unix socketpair whose other end stays in slurmstepd,
and names it in `PMI_FD`. The wrapper is that task process; the tree the agent starts gets only stdio, so
the socket is handed into the tree by a one-shot helper (`python -m slurmckpt.slurm.pmi -- PROG ARGS`, run inside
the tree as the job's user): it receives the fd from the wrapper over an abstract unix socket (SCM_RIGHTS,
peer uid checked both ways), puts it at the number `PMI_FD` names and execs the program. The tree thus
holds exactly the socket it would hold without slurmckpt.

At a capture that socket is dumped as an external resource (`--external unix[INO]`) and at the restore the
new step's socket (the requeued task's own `PMI_FD`) takes its place (`--inherit-fd`): the new slurmstepd
serves what MPICH still asks after MPI_Init (barrier and finalize in MPI_Finalize, abort) once the agent
has opened it with the PMI-1 `init` the program sent to the old one (`reinit`). A capture is not taken
while a PMI exchange is under way (bytes in flight on the socket, or a thread waiting for slurmstepd's
answer): the lock round thaws and tries again (`require_no_exchange`). Only the PMI-1 wire protocol is
replayed (docs/mpi.md).
"""
from __future__ import annotations

import array
import fcntl
import os
import secrets
import select
import socket
import stat
import struct
import sys
import termios
import threading
import time

from slurmckpt.node import procfs
from slurmckpt.errors import ExchangeInFlight, ProtocolError, RestoreError

PMI_FD = "PMI_FD"                        # Slurm's mpi/pmi2 plugin (and hydra) name the socket here
HANDOVER = "SLURMCKPT_PMI_HANDOVER"      # abstract socket name the helper in the tree fetches it from
SIOCOUTQ = 0x5411                         # TIOCOUTQ: bytes sent and not yet read by the peer
HANDOVER_TIMEOUT_S = 60.0
# Syscalls of a PMI client inside an exchange, by machine: it blocks in read() for slurmstepd's answer (MPICH's
# simple PMI and Slurm's libpmi2 do), or is frozen on its way out of the write() of its request. The fd is
# the first argument of each.
EXCHANGE_SYSCALLS = {
    "x86_64": {0: "read", 17: "pread64", 19: "readv", 45: "recvfrom", 47: "recvmsg", 295: "preadv",
               299: "recvmmsg", 327: "preadv2",
               1: "write", 18: "pwrite64", 20: "writev", 44: "sendto", 46: "sendmsg"},
    "aarch64": {63: "read", 65: "readv", 67: "pread64", 69: "preadv", 207: "recvfrom", 212: "recvmsg",
                243: "recvmmsg", 286: "preadv2",
                64: "write", 66: "writev", 68: "pwrite64", 206: "sendto", 211: "sendmsg"},
}


# Every CPU task runs in its own PID namespace, so ranks of one node cannot reach each other's shared memory
# through pids (UCX's posix transport opens /proc/<peer pid>/fd/N: "Permission denied"; CMA and xpmem need
# the peer's pid too), and a deleted segment mapped by two ranks cannot be restored by their separate criu
# runs (ipc.py). MPICH then talks to the other ranks of its node over TCP (docs/mpi.md). Set only where the
# job's environment does not choose itself.
RANK_DEFAULTS = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}


def rank_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with RANK_DEFAULTS added where unset (a rank that srun started in its own PID namespace)."""
    return {**RANK_DEFAULTS, **env}


def task_socket(environ: dict[str, str]) -> int | None:
    """The task's PMI socket (from `PMI_FD`), or None when the task has none or it is not a unix stream
    socket (then the program is left to find that out itself, as it would without slurmckpt)."""
    value = environ.get(PMI_FD, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        require_unix_stream(fd)
    except (OSError, ProtocolError):
        return None
    return fd


def require_unix_stream(fd: int) -> int:
    """The inode of `fd` if it is a unix stream socket; ProtocolError otherwise. Checked through the fd
    itself (the agent does this with the fd the wrapper handed over, never with a path or a pid)."""
    st = os.fstat(fd)
    if not stat.S_ISSOCK(st.st_mode):
        raise ProtocolError("the PMI fd is not a socket", fd=fd)
    s = socket.socket(fileno=os.dup(fd))
    try:
        if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
            raise ProtocolError("the PMI fd is not a unix stream socket", fd=fd)
    finally:
        s.close()
    return st.st_ino


def bytes_in_flight(fd: int) -> tuple[int, int]:
    """(bytes unread by us, bytes of buffers sent by us that slurmstepd has not read) on the PMI socket."""
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    unread = buf[0]
    fcntl.ioctl(fd, SIOCOUTQ, buf, True)
    return unread, buf[0]


def reinit(fd: int, timeout_s: float = 10.0) -> None:
    """Open the new step's PMI connection the way the program once opened the old one (PMI-1 wire: MPICH's
    simple PMI client): slurmstepd's pmi2 plugin takes the first line of a task's socket as its `init` and
    refuses anything else there, while the restored program is long past its init. RestoreError if
    slurmstepd does not answer rc=0 in time."""
    request = b"cmd=init pmi_version=1 pmi_subversion=1\n"
    view = memoryview(request)
    while view:
        view = view[os.write(fd, view):]
    answer = b""
    deadline = time.monotonic() + timeout_s
    while not answer.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RestoreError("slurmstepd did not answer the PMI init on the new step's PMI socket")
        chunk = os.read(fd, 256)
        if not chunk:
            raise RestoreError("slurmstepd closed the new step's PMI socket at its init")
        answer += chunk
    fields = dict(f.split("=", 1) for f in answer.decode(errors="replace").split() if "=" in f)
    if fields.get("cmd") != "response_to_init" or fields.get("rc") != "0":
        raise RestoreError(f"slurmstepd refused the PMI init on the new step's socket: {answer!r}")


def waiting_for_answer(pids: list[int], ino: int, machine: str | None = None) -> tuple[int, int, str] | None:
    """(pid, tid, syscall) of a thread of `pids` in a read or write on the PMI socket `ino`, or None.

    Such a rank sent a request that slurmstepd has already read (so no byte is in flight) and waits for the
    answer: a PMI barrier or fence in MPI_Init or MPI_Finalize, a KVS get. Captured there, the restored rank
    would wait for an answer from the new slurmstepd, which never got the request. Read from
    /proc/PID/task/TID/syscall of the frozen tree; the fd number is checked against the socket's inode."""
    calls = EXCHANGE_SYSCALLS.get(machine or os.uname().machine, {})
    key = f"socket:[{ino}]"
    for pid in pids:
        for tid in procfs.threads(pid):
            blocked = procfs.blocked_syscall(pid, tid)
            if blocked is None or blocked[0] not in calls:
                continue
            try:
                if procfs.fd_link(pid, blocked[1][0]) == key:
                    return pid, tid, calls[blocked[0]]
            except OSError:
                continue
    return None


def require_no_exchange(fd: int, ino: int, pids: list[int], step: str, rank: int) -> None:
    """The frozen tree is between PMI exchanges: nothing in flight on the socket, no thread waiting for an
    answer. ExchangeInFlight (retryable: the coordinator thaws every rank and tries the round again) if not."""
    unread, unsent = bytes_in_flight(fd)
    if unread or unsent:
        raise ExchangeInFlight(f"the rank's PMI connection to slurmstepd has bytes in flight ({unread} unread, "
                               f"{unsent} queued for slurmstepd): a PMI exchange (MPI_Init, MPI_Finalize, a "
                               "name lookup) is in progress", step=step, rank=rank)
    waiting = waiting_for_answer(pids, ino)
    if waiting:
        pid, tid, call = waiting
        doing = (f"waits in {call}() for slurmstepd's answer to a PMI request" if "read" in call or "recv" in call
                 else f"is sending a PMI request in {call}(), and will wait for slurmstepd's answer")
        raise ExchangeInFlight(f"thread {tid} of pid {pid} {doing} (a barrier in MPI_Init or MPI_Finalize): "
                               "captured now, the restored rank would wait for an answer the next step never "
                               "gets the request for", step=step, rank=rank)


class Handover:
    """Wrapper side: serves the PMI fd once, to a process of the job's user, over an abstract socket with an
    unguessable name that only the tree's environment carries."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.name = f"slurmckpt-pmi-{os.getpid()}-{secrets.token_hex(16)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind("\0" + self.name)
        self.listener.listen(1)
        self.listener.settimeout(HANDOVER_TIMEOUT_S)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._serve, name="pmi-handover", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                    if uid != os.getuid():
                        continue               # not the job's user: never hand the socket over
                    socket.send_fds(conn, [b"P"], [self.fd])
                    return
        except OSError as e:
            self.error = f"PMI socket hand-over failed: {e}"
        finally:
            self.listener.close()


def attach(environ: dict[str, str]) -> None:
    """Tree side: fetch the PMI socket from the wrapper and put it where `PMI_FD` says."""
    name = environ.pop(HANDOVER)
    target = int(environ[PMI_FD])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(HANDOVER_TIMEOUT_S)
        s.connect("\0" + name)
        _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise OSError(f"the PMI hand-over socket belongs to uid {uid}, not to this job's user")
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
    if len(fds) != 1:
        raise OSError("the wrapper sent no PMI socket")
    if fds[0] != target:
        os.dup2(fds[0], target, inheritable=True)
        os.close(fds[0])
    else:
        os.set_inheritable(target, True)


def attach_argv(argv: list[str]) -> list[str]:
    """The command line that runs `argv` inside the tree with the PMI socket in place."""
    return [sys.executable, "-m", "slurmckpt.slurm.pmi", "--", *argv]


def main(args: list[str]) -> None:
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("slurmckpt.pmi: no command to run")
    environ = dict(os.environ)
    try:
        attach(environ)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"slurmckpt: cannot give {args[0]} its PMI connection to slurmstepd: {e}")
    try:
        os.execvpe(args[0], args, environ)
    except OSError as e:
        sys.exit(f"slurmckpt: cannot run {args[0]}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
