"""Our CRIU patch 0005 with the real criu as CI installs it: a listening unix socket bound in a private temporary
directory (Python's multiprocessing puts its resource sharer's listener in /tmp/pymp-XXXXXX, and PyTorch's
DataLoader workers pass tensors through it) comes back although the directory is gone at the restore (another
node; or the program removed it after the dump). The directory is made again by the task's identity, not root's,
mode 0700 as mkdtemp made it. On the GPU machine this failed the DataLoader row's restore ("Can't bind id ...
addr /tmp/pymp-.../listener-...: No such file or directory"). Needs root, criu and the test user of
`scripts/setup.sh users`."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from criu_processes import kill_all, wait_for_marker

CRIU = os.environ.get("SLURMCKPT_CRIU", "/usr/local/sbin/criu")
USER = "ckptuser1"
PYTHON = "/usr/bin/python3"          # Debian's, which the user can read (criu reopens its files as the task)
WORK = Path("/var/tmp/slurmckpt-work") / USER           # the user's own directory (setup.sh users)
LISTENER = ("import os, socket, sys, tempfile\n"
            "d = tempfile.mkdtemp(prefix='pymp-', dir=sys.argv[1])\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "s.bind(os.path.join(d, 'listener-test'))\n"
            "s.listen()\n"
            "open(sys.argv[2], 'w').write(os.path.join(d, 'listener-test'))\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    c.sendall(b'alive %d' % os.getpid())\n"
            "    c.close()\n")


@pytest.fixture
def listener(tmp_path: Path):
    """A process of the test user, in a session of its own, listening on a socket in a mkdtemp directory of
    WORK; yields (its Popen, the pids to kill, the socket's path)."""
    if os.geteuid() != 0:
        pytest.fail("needs root (criu dump and restore); CI and `make test` run as root")
    assert os.path.exists(CRIU), f"{CRIU} missing: make setup builds our patched CRIU"
    user = pwd.getpwnam(USER)          # KeyError: the test users are missing (scripts/setup.sh users)
    assert WORK.is_dir(), f"{WORK} missing: scripts/setup.sh users makes it"
    base = WORK / f"sockdir-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    os.chown(base, user.pw_uid, user.pw_gid)
    marker = base / "path"
    p = subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                          PYTHON, "-c", LISTENER, str(base), str(marker)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    wait_for_marker(marker)
    pids = [p.pid]
    yield p, pids, Path(marker.read_text())
    kill_all(p, pids)
    shutil.rmtree(base, ignore_errors=True)


def criu(*args: str, log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CRIU, *args, "-v4", "-o", str(log)], capture_output=True, text=True, timeout=120)


def ask(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        return s.recv(64)


@pytest.mark.system
def test_a_socket_whose_directory_is_gone_is_bound_again_in_a_directory_the_user_owns(listener, tmp_path: Path):
    process, pids, path = listener
    assert ask(path).startswith(b"alive")
    images = tmp_path / "images"
    images.mkdir()
    dumped = criu("dump", "-t", str(process.pid), "-D", str(images), "--shell-job", log=images / "dump.log")
    assert dumped.returncode == 0, (images / "dump.log").read_text()[-3000:]
    assert process.wait(timeout=10) == -signal.SIGKILL
    shutil.rmtree(path.parent)                   # the program's temporary directory is gone

    restored = criu("restore", "-D", str(images), "-d", "--shell-job", "--pidfile", str(tmp_path / "pid"),
                    log=images / "restore.log")
    log = (images / "restore.log").read_text()
    assert restored.returncode == 0, log[-3000:]
    pids.append(int((tmp_path / "pid").read_text()))
    assert f"made the missing directory {path.parent}" in log
    made = path.parent.stat()
    user = pwd.getpwnam(USER)
    assert (made.st_uid, made.st_gid) == (user.pw_uid, user.pw_gid), "the directory was made as root"
    assert stat.S_IMODE(made.st_mode) == 0o700
    assert ask(path) == b"alive %d" % pids[-1]       # the restored process serves on its old address
