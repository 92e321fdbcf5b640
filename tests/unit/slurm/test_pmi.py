"""The PMI socket of an `srun --mpi=pmi2` rank (pmi.py): hand-over into the tree, idle check, re-init."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from slurmckpt.slurm import pmi
from slurmckpt.node import procfs
from slurmckpt.errors import ExchangeInFlight, ProtocolError, RestoreError, is_retryable
from tests.support.pmi_client import waiting_client


def test_the_helper_gets_the_wrappers_socket_at_the_number_pmi_fd_names() -> None:
    """The tree side receives the very socket the wrapper holds (same inode), at PMI_FD's number, inheritable,
    and the hand-over name leaves the program's environment."""
    ours, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    handover = pmi.Handover(ours.fileno())
    target = os.open("/dev/null", os.O_RDONLY)       # a free number to land on (replaced by dup2)
    env = {pmi.HANDOVER: handover.name, pmi.PMI_FD: str(target), "X": "1"}
    try:
        pmi.attach(env)
        assert os.fstat(target).st_ino == os.fstat(ours.fileno()).st_ino
        assert os.get_inheritable(target)
        assert env == {pmi.PMI_FD: str(target), "X": "1"}
        os.write(target, b"ping")
        assert stepd.recv(4) == b"ping"
        handover.thread.join(5)
        assert handover.error is None
    finally:
        os.close(target)
        ours.close()
        stepd.close()


def test_the_hand_over_serves_once() -> None:
    """After one hand-over the name is gone: nothing else can fetch the socket."""
    ours, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    handover = pmi.Handover(ours.fileno())
    target = os.open("/dev/null", os.O_RDONLY)
    try:
        pmi.attach({pmi.HANDOVER: handover.name, pmi.PMI_FD: str(target)})
        handover.thread.join(5)
        with pytest.raises(OSError):
            pmi.attach({pmi.HANDOVER: handover.name, pmi.PMI_FD: str(target)})
    finally:
        os.close(target)
        ours.close()
        stepd.close()


def test_only_a_unix_stream_socket_is_a_pmi_socket() -> None:
    r, w = os.pipe()
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for fd in (r, dgram.fileno()):
            with pytest.raises(ProtocolError):
                pmi.require_unix_stream(fd)
        assert pmi.task_socket({pmi.PMI_FD: str(r)}) is None
        assert pmi.task_socket({}) is None and pmi.task_socket({pmi.PMI_FD: "x"}) is None
    finally:
        os.close(r)
        os.close(w)
        dgram.close()


def test_a_capture_is_refused_while_pmi_bytes_are_in_flight() -> None:
    """Unread answers from slurmstepd, or requests it has not read yet, would be lost with the old step: the
    error is typed retryable (the lock round thaws and tries again)."""
    ours, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ino = os.fstat(ours.fileno()).st_ino
    try:
        pmi.require_no_exchange(ours.fileno(), ino, [], "0", 1)
        stepd.send(b"cmd=barrier_out\n")
        with pytest.raises(ExchangeInFlight, match="16 unread") as e:
            pmi.require_no_exchange(ours.fileno(), ino, [], "0", 1)
        assert is_retryable(e.value)
        ours.recv(64)
        ours.send(b"cmd=finalize\n")
        with pytest.raises(ExchangeInFlight, match=r"0 unread, [1-9]\d* queued for slurmstepd"):
            pmi.require_no_exchange(ours.fileno(), ino, [], "0", 1)
    finally:
        ours.close()
        stepd.close()


def until(probe, timeout: float = 5.0):
    """The first true value `probe()` gives within `timeout` seconds (its last value if none)."""
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def test_a_rank_waiting_for_slurmstepds_answer_is_found_through_its_threads_syscall() -> None:
    """slurmstepd has read the request, so nothing is in flight, but the rank waits for the answer (a PMI
    barrier in MPI_Finalize): the check names the thread and the syscall and is retryable. Once answered,
    the same tree passes; a thread blocked reading another fd is not taken for one."""
    theirs, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ino = os.fstat(theirs.fileno()).st_ino
    child = waiting_client(theirs)
    try:
        assert stepd.recv(64) == b"cmd=barrier_in\n"
        assert pmi.bytes_in_flight(theirs.fileno()) == (0, 0)
        # The read drained the socket, which wakes its waiters: the unfrozen child shows "running" for a
        # moment before it sleeps in read() again (the agent looks at a frozen tree, where it cannot)
        assert until(lambda: pmi.waiting_for_answer([child.pid], ino)) == (child.pid, child.pid, "read")
        with pytest.raises(ExchangeInFlight, match=rf"thread {child.pid} of pid {child.pid} waits in read\(\)") as e:
            pmi.require_no_exchange(theirs.fileno(), ino, [child.pid], "0", 1)
        assert is_retryable(e.value)
        other, _peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        assert pmi.waiting_for_answer([child.pid], os.fstat(other.fileno()).st_ino) is None
        other.close()
        _peer.close()
        stepd.send(b"cmd=barrier_out\n")
        assert child.wait(10) == 0
        pmi.require_no_exchange(theirs.fileno(), ino, [child.pid], "0", 1)
    finally:
        child.kill()
        child.wait()
        theirs.close()
        stepd.close()


def test_a_rank_inside_the_write_of_its_request_is_found_too() -> None:
    """A thread in write() on the PMI socket is inside an exchange as well (frozen on its way out of sending a
    request, or blocked because slurmstepd is not reading): found and named as sending."""
    theirs, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = theirs.fileno()
    child = subprocess.Popen([sys.executable, "-c", f"import os; os.write({fd}, b'x' * (64 << 20))"], pass_fds=(fd,))
    try:
        deadline = time.monotonic() + 10
        while (found := pmi.waiting_for_answer([child.pid], os.fstat(fd).st_ino)) is None:
            assert time.monotonic() < deadline, "the child never blocked writing to its PMI socket"
            time.sleep(0.02)
        assert found == (child.pid, child.pid, "write")
        with pytest.raises(ExchangeInFlight, match=r"queued for slurmstepd"):     # what it sent is still queued
            pmi.require_no_exchange(fd, os.fstat(fd).st_ino, [child.pid], "0", 1)
    finally:
        child.kill()
        child.wait()
        theirs.close()
        stepd.close()


def test_syscall_numbers_are_read_as_the_thread_reports_them(tmp_path) -> None:
    """/proc/PID/task/TID/syscall: a number and six hex arguments while blocked; "running" or -1 otherwise."""
    task = tmp_path / "5" / "task" / "6"
    task.mkdir(parents=True)
    with procfs.rooted(tmp_path):
        for text, expect in [("0 0x3 0x7f 0x400 0x0 0x0 0x0 0x7ffc 0x7f1\n", (0, [3, 0x7f, 0x400, 0, 0, 0])),
                             ("running\n", None), ("-1 0x7ffc 0x7f1\n", None)]:
            (task / "syscall").write_text(text)
            assert procfs.blocked_syscall(5, 6) == expect
        assert procfs.blocked_syscall(5, 7) is None          # gone
        assert procfs.threads(5) == [6]
    assert pmi.EXCHANGE_SYSCALLS["aarch64"][63] == "read" and pmi.EXCHANGE_SYSCALLS["x86_64"][0] == "read"


def _stepd(sock: socket.socket, answer: bytes | None, seen: list[bytes]) -> None:
    seen.append(sock.recv(256))
    if answer is None:
        sock.shutdown(socket.SHUT_WR)
    else:
        sock.send(answer)


@pytest.mark.parametrize("answer,error", [
    (b"cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n", None),
    (b"cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=-1\n", "refused the PMI init"),
    (None, "closed the new step's PMI socket"),
])
def test_the_new_steps_socket_is_opened_with_a_pmi1_init(answer, error) -> None:
    """The restore sends the PMI-1 init the program once sent, and fails loudly unless slurmstepd says rc=0."""
    ours, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    seen: list[bytes] = []
    t = threading.Thread(target=_stepd, args=(stepd, answer, seen))
    t.start()
    try:
        if error is None:
            pmi.reinit(ours.fileno())
        else:
            with pytest.raises(RestoreError, match=error):
                pmi.reinit(ours.fileno())
        t.join(5)
        assert seen == [b"cmd=init pmi_version=1 pmi_subversion=1\n"]
    finally:
        ours.close()
        stepd.close()


def test_a_silent_slurmstepd_times_out() -> None:
    ours, stepd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(RestoreError, match="did not answer"):
            pmi.reinit(ours.fileno(), timeout_s=0.2)
    finally:
        ours.close()
        stepd.close()


def test_rank_defaults_never_override_the_jobs_own_choice() -> None:
    env = pmi.rank_env({"UCX_TLS": "rc,sm", "A": "b"})
    assert env == {"UCX_TLS": "rc,sm", "MPIR_CVAR_NOLOCAL": "1", "A": "b"}
    assert pmi.rank_env({})["UCX_TLS"] == "tcp,self"
