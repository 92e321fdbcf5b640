"""Detection of state a rank shares with another checkpointed tree (ipc.py), on real processes."""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from slurmckpt.node import sock_diag
from slurmckpt.rank.sharing import ipc
from slurmckpt.identity import TreeName
from slurmckpt.node.launch import Credentials
from slurmckpt.node.task_cgroup import TaskCgroup

OTHER = "job 9 step 0 rank 1"


def holder(*fds: int, script: str = "") -> subprocess.Popen:
    """A process that keeps `fds` (and whatever `script` opens) until killed."""
    code = script + "\nimport sys, time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def pair(procs, a_fds=(), b_fds=(), a_script="", b_script=""):
    a, b = holder(*a_fds, script=a_script), holder(*b_fds, script=b_script)
    procs += [a, b]
    return a, b


def test_parse_unix_diag_reads_name_peer_and_done() -> None:
    def attr(atype: int, payload: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(payload), atype) + payload
        return raw + b"\0" * (-len(raw) % 4)
    body = struct.pack("=BBBBIII", socket.AF_UNIX, socket.SOCK_DGRAM, 1, 0, 77, 0, 0) + \
        attr(sock_diag.UNIX_DIAG_NAME, b"/run/x.sock") + attr(sock_diag.UNIX_DIAG_PEER, struct.pack("=I", 78))
    msg = struct.pack("=IHHII", 16 + len(body), 20, 2, 1, 0) + body
    abstract = struct.pack("=BBBBIII", socket.AF_UNIX, socket.SOCK_STREAM, 10, 0, 80, 0, 0) + \
        attr(sock_diag.UNIX_DIAG_NAME, b"\0abs")
    msg2 = struct.pack("=IHHII", 16 + len(abstract), 20, 2, 1, 0) + abstract
    done, found = sock_diag.parse_unix_diag(msg + msg2)
    assert not done
    assert found[77] == sock_diag.UnixSocket(77, socket.SOCK_DGRAM, "/run/x.sock", 78)
    assert found[80] == sock_diag.UnixSocket(80, socket.SOCK_STREAM, "@abs", 0)
    done, found = sock_diag.parse_unix_diag(struct.pack("=IHHII", 20, sock_diag.NLMSG_DONE, 2, 1, 0) + b"\0" * 4)
    assert done and found == {}


def test_unix_sockets_sees_a_socketpair_with_peers() -> None:
    a, b = socket.socketpair()
    try:
        ia, ib = os.fstat(a.fileno()).st_ino, os.fstat(b.fileno()).st_ino
        found = sock_diag.unix_sockets()
        assert found[ia].peer == ib and found[ib].peer == ia and found[ia].type == socket.SOCK_STREAM
    finally:
        a.close(), b.close()


def test_stream_socket_split_across_trees_is_refused_and_named(procs, tmp_path: Path) -> None:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(tmp_path / "srv.sock"))
    srv.listen(1)
    cli = socket.socket(socket.AF_UNIX)
    cli.connect(str(tmp_path / "srv.sock"))
    conn, _ = srv.accept()
    a, b = pair(procs, a_fds=(cli.fileno(),), b_fds=(conn.fileno(), srv.fileno()))
    for s in (cli, conn, srv):
        s.close()
    problems = ipc.unshareable([a.pid], {b.pid: OTHER})
    assert len(problems) == 1
    assert "stream socket" in problems[0] and str(tmp_path / "srv.sock") in problems[0] and OTHER in problems[0]
    # the same connection inside one tree is criu's business, and fine
    assert ipc.unshareable([a.pid, b.pid], {}) == []


def test_stream_socket_to_a_process_outside_any_task_is_refused(procs) -> None:
    x, y = socket.socketpair()
    a = holder(x.fileno())
    procs.append(a)
    try:
        problems = ipc.unshareable([a.pid], {})
        assert len(problems) == 1 and "outside this task" in problems[0]
        # unless it is the task's stdio, which the restore hands in (--inherit-fd)
        assert ipc.unshareable([a.pid], {}, inherited={f"socket:[{os.fstat(x.fileno()).st_ino}]"}) == []
    finally:
        x.close(), y.close()


def test_datagram_socket_connected_to_another_rank_is_refused(procs, tmp_path: Path) -> None:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "rx.sock"))
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.connect(str(tmp_path / "rx.sock"))
    a, b = pair(procs, a_fds=(tx.fileno(),), b_fds=(rx.fileno(),))
    rx.close(), tx.close()
    sender = ipc.unshareable([a.pid], {b.pid: OTHER})
    receiver = ipc.unshareable([b.pid], {a.pid: OTHER})
    assert len(sender) == 1 and "connected to" in sender[0] and "rx.sock" in sender[0]
    assert len(receiver) == 1 and "receives from" in receiver[0] and "rx.sock" in receiver[0]


def test_datagram_socket_connected_to_a_daemon_is_allowed(procs, tmp_path: Path) -> None:
    """Like /dev/log: criu reconnects it by path; the daemon is not a checkpointed task."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "log.sock"))
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.connect(str(tmp_path / "log.sock"))
    a = holder(tx.fileno())
    procs.append(a)
    tx.close()
    try:
        assert ipc.unshareable([a.pid], {}) == []
    finally:
        rx.close()


def test_bound_datagram_socket_and_unconnected_sender_in_another_rank_are_refused(procs, tmp_path: Path) -> None:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "rx.sock"))
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)          # sendto(path) each time
    a, b = pair(procs, a_fds=(tx.fileno(),), b_fds=(rx.fileno(),))
    rx.close(), tx.close()
    assert any("rx.sock" in p and "unconnected" in p for p in ipc.unshareable([b.pid], {a.pid: OTHER}))
    assert any("unconnected" in p and OTHER in p for p in ipc.unshareable([a.pid], {b.pid: OTHER}))
    assert ipc.unshareable([a.pid], {}) == [] and ipc.unshareable([b.pid], {}) == []


def test_fifo_open_in_two_trees_is_refused(procs, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    a, b = pair(procs, a_script=f"import os; f = os.open({str(fifo)!r}, os.O_RDWR)",
                b_script=f"import os; f = os.open({str(fifo)!r}, os.O_RDWR)")
    problems = ipc.unshareable([a.pid], {b.pid: OTHER})
    assert len(problems) == 1 and f"named pipe {fifo}" in problems[0] and OTHER in problems[0]
    assert ipc.unshareable([a.pid, b.pid], {}) == []


def test_anonymous_pipe_shared_with_another_tree_is_refused(procs) -> None:
    r, w = os.pipe()
    a, b = pair(procs, a_fds=(r,), b_fds=(w,))
    os.close(r), os.close(w)
    problems = ipc.unshareable([a.pid], {b.pid: OTHER})
    assert len(problems) == 1 and problems[0].startswith("pipe pipe:[")
    # unless it is the task's stdio: each rank's restore hands in its own task's (--inherit-fd)
    assert ipc.unshareable([a.pid], {b.pid: OTHER}, inherited={problems[0].split()[1]}) == []


def test_deleted_shared_mapping_is_refused_but_a_linked_one_is_not(procs, tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"slurmckpt-test-{os.getpid()}"
    shm.write_bytes(b"\0" * 4096)
    script = f"import mmap, os\nfd = os.open({str(shm)!r}, os.O_RDWR)\nm = mmap.mmap(fd, 4096, mmap.MAP_SHARED)"
    try:
        a, b = pair(procs, a_script=script, b_script=script)
        assert ipc.unshareable([a.pid], {b.pid: OTHER}) == []        # linked: restored in place
        shm.unlink()
        problems = ipc.unshareable([a.pid], {b.pid: OTHER})
        assert len(problems) == 1 and f"deleted file {shm}" in problems[0] and OTHER in problems[0]
        assert ipc.unshareable([a.pid, b.pid], {}) == []             # one tree: one criu ghost file
    finally:
        shm.unlink(missing_ok=True)


def test_sysv_shared_memory_is_refused_even_in_one_tree(procs) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, 4096, 0o1600)          # IPC_PRIVATE | IPC_CREAT
    assert shmid >= 0
    try:
        a = holder(script=f"import ctypes\nl = ctypes.CDLL(None)\nl.shmat.restype = ctypes.c_void_p\n"
                          f"assert l.shmat({shmid}, None, 0) not in (None, 2**64 - 1)")
        procs.append(a)
        problems = ipc.unshareable([a.pid], {})
        assert len(problems) == 1 and "SysV shared memory" in problems[0] and f"shmid {shmid}" in problems[0]
    finally:
        libc.shmctl(shmid, 0, None)                   # IPC_RMID


def test_other_trees_reads_sibling_cgroups_and_their_names(tmp_path: Path) -> None:
    """The node's other trees are the sibling cgroups of ours, named job.step.rank.restart; a directory with
    another name is nobody's tree."""
    for name, pids in (("12.0.0.0", "100\n"), ("12.0.1.0", "101\n102\n"), ("12.batch.0.0", "103\n"),
                       ("13.0.0.0", "104\n"), ("odd", "105\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text(pids)
    mine = TaskCgroup(tmp_path / "12.0.0.0", TreeName(12, "0", 0, 0))
    assert {pid: str(t) for pid, t in mine.other_trees().items()} == \
        {101: "12.0.1.0", 102: "12.0.1.0", 103: "12.batch.0.0", 104: "13.0.0.0"}
    assert TaskCgroup(tmp_path / "missing" / "1.0.0.0", TreeName(1, "0", 0, 0)).other_trees() == {}
    assert TreeName.parse("12.batch.0.3") == TreeName(12, "batch", 0, 3)
    assert TreeName.parse("x") is None and TreeName.parse("1.b.0.0") is None and TreeName.parse("1.0.0") is None
    assert TreeName(12, "0", 1, 0).label == "job 12 step 0 rank 1"


@pytest.mark.system
def test_files_mapped_shared_with_another_rank_are_fingerprinted_and_checked(procs, tmp_path: Path) -> None:
    from slurmckpt.errors import RestoreError
    from slurmckpt.store.jobstore import file_checksum
    shm = Path("/dev/shm") / f"slurmckpt-test-fp-{os.getpid()}"
    shm.write_bytes(b"a" * 4096)
    rw = f"import mmap, os\nfd = os.open({str(shm)!r}, os.O_RDWR)\nm = mmap.mmap(fd, 4096, mmap.MAP_SHARED)"
    ro = f"import mmap, os\nfd = os.open({str(shm)!r}, os.O_RDONLY)\nm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, " \
         "mmap.PROT_READ)"
    me = Credentials(os.getuid(), os.getgid(), tuple(os.getgroups()), ())
    try:
        a, b = pair(procs, a_script=rw, b_script=ro)
        c = holder(script=ro)
        procs.append(c)
        assert ipc.shared_files([a.pid], {b.pid}) == [str(shm)]
        assert ipc.shared_files([b.pid], {c.pid}) == [], "read-only on both sides: nothing can change it"
        assert ipc.shared_files([a.pid], set()) == []
        entries = ipc.fingerprint_files([a.pid], [str(shm)])
        st = shm.stat()
        assert entries == [{"path": str(shm), "size": 4096, "xxh3": file_checksum(shm), "dev": st.st_dev,
                            "ino": st.st_ino}]

        ipc.check_shared_files(entries, "j.0.1", me, True, tmp_path)   # unchanged: restorable
        shm.write_bytes(b"b" * 4096)                                   # a restored rank writes to it...
        ipc.check_shared_files(entries, "j.0.1", me, True, tmp_path)   # ...peers share the verdict
        with pytest.raises(RestoreError, match="changed since the checkpoint"):
            ipc.check_shared_files(entries, "j.0.2", me, True, tmp_path)   # written after it
        with pytest.raises(RestoreError, match="changed"):
            ipc.check_shared_files(entries, "j.0.2", me, True, tmp_path)   # every rank fails
        shm.write_bytes(b"a" * 4096)
        other = Credentials(os.getuid() + 1, os.getgid(), tuple(os.getgroups()), ())
        if os.getuid() == 0:
            os.chown(shm, other.uid, -1)
        with pytest.raises(RestoreError, match="job's user"):
            ipc.check_shared_files(entries, "j.0.3", me, True, tmp_path)   # someone else's file
        os.chown(shm, os.getuid(), -1)
        same = shm.read_bytes()
        shm.unlink()
        shm.write_bytes(same)                                          # same bytes, another file
        with pytest.raises(RestoreError, match="not the file mapped at the checkpoint"):
            ipc.check_shared_files(entries, "j.0.6", me, True, tmp_path)
        shm.unlink()
        with pytest.raises(RestoreError, match="cannot be opened"):
            ipc.check_shared_files(entries, "j.0.4", me, True, tmp_path)       # another node
        ipc.check_shared_files([], "j.0.5", me, True, tmp_path)
    finally:
        shm.unlink(missing_ok=True)


@pytest.mark.system      # drops to another uid
def test_shared_file_check_is_no_existence_oracle_for_unreadable_directories(tmp_path: Path) -> None:
    """The path of a file mapped shared is the user's: swapped for one inside a directory only root may
    read, the check must answer as it would for the user (who cannot tell whether the file exists), never
    as root. Root's own open (the old check) tells the two apart: the attack's premise."""
    from slurmckpt.errors import RestoreError
    secret = tmp_path / "rootonly"
    secret.mkdir(mode=0o700)
    (secret / "present").write_bytes(b"x" * 4096)
    nobody = Credentials(65534, 65534, (), ())
    answers = {}
    for name in ("present", "absent"):
        try:
            os.close(os.open(secret / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
            answers[f"root {name}"] = "opened"
        except OSError as e:
            answers[f"root {name}"] = e.strerror
        entry = {"path": str(secret / name), "size": 4096, "xxh3": "0", "dev": 0, "ino": 0}
        with pytest.raises(RestoreError) as err:
            ipc.check_shared_files([entry], f"j.1.{name}", nobody, True, tmp_path / "locks")
        answers[name] = str(err.value).replace(name, "NAME")
    assert answers["root present"] != answers["root absent"], "premise: root's open is an existence oracle"
    assert answers["present"] == answers["absent"], answers
    assert "Permission denied" in answers["present"]


def test_nccl_shared_memory_gets_a_hint(procs) -> None:
    shm = Path("/dev/shm") / f"nccl-slurmckpt-test-{os.getpid()}"
    shm.write_bytes(b"\0" * 4096)
    script = f"import mmap, os\nfd = os.open({str(shm)!r}, os.O_RDWR)\nm = mmap.mmap(fd, 4096, mmap.MAP_SHARED)"
    try:
        a, b = pair(procs, a_script=script, b_script=script)
        shm.unlink()
        problems = ipc.unshareable([a.pid], {b.pid: OTHER})
        assert len(problems) == 1 and "NCCL_SHM_DISABLE=1" in problems[0]
    finally:
        shm.unlink(missing_ok=True)


def test_sysv_segment_with_shmid_0_is_seen(tmp_path: Path, monkeypatch) -> None:
    """In a fresh IPC namespace the first segment's shmid (its inode in /proc/PID/maps) is 0."""
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 rw-s 00000000 00:01 0                          /SYSV00000000 (deleted)\n"
                    "7f0000002000-7f0000003000 rw-s 00000000 00:01 0                          /dev/zero (deleted)\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(maps if str(path) == "/proc/4242/maps"
                                                                          else path, *a, **k))
    found = ipc._mappings(4242)
    assert [(key, path) for key, path, _, _ in found] == [(("00:01", 0), "/SYSV00000000 (deleted)")]
