"""The srun stand-in and the wrapper's relay, on real sockets and real processes: the stand-in's request runs
the real srun (here a small script) outside it with the stand-in's argv, environment and stdio; its exit,
the signals between them and a restored stand-in's resend (srun_standin.py, srun_relay.py)."""
from __future__ import annotations

import atexit
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from slurmckpt.channel import Channel
from slurmckpt.errors import PermissionDenied, ProtocolError
from slurmckpt.node.launch import relay_dir
from slurmckpt.task.srun_relay import STEP_TOKEN, SrunRelay, request_of
from slurmckpt.task.srun_standin import REAL_SRUN, RELAY, connect, exec_real, install

SRC = str(Path(__file__).resolve().parents[3] / "src")


class Relay:
    """A relay whose 'real srun' is `script`, with a reaper standing in for the wrapper's waitpid loop."""

    def __init__(self, tmp_path: Path, script: str, where: Path | None = None) -> None:
        fake = tmp_path / "real-srun"
        fake.write_text("#!/bin/sh\n" + script)
        fake.chmod(0o755)
        self.calls: list[tuple[str, int]] = []
        self.said: list[str] = []
        self.relay = SrunRelay(str((where or tmp_path) / f"relay-{secrets.token_hex(4)}"), str(tmp_path), self._call,
                               self.said.append)
        self.relay.real = str(fake)
        self.stop = False
        threading.Thread(target=self._reap, daemon=True).start()

    def _call(self, op: str, fds: list[int] | None = None, **args) -> dict:
        self.calls.append((op, len(fds or [])))
        return {"ino": 1}

    def _reap(self) -> None:
        while not self.stop:
            for pid in list(self.relay.sessions):
                try:
                    done, raw = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if done:
                    self.relay.reaped(pid, os.waitstatus_to_exitcode(raw))
            time.sleep(0.02)

    def standin(self, argv: list[str], tmp_path: Path) -> subprocess.Popen:
        """A stand-in process (its serve loop, as after the launcher check) sending `argv`."""
        code = ("import os, sys; from slurmckpt.task.srun_standin import connect, serve; from slurmckpt.channel import "
                f"Channel; sys.exit(serve(Channel(connect({self.relay.name!r})), {{'argv': {argv!r}, "
                f"'env': {{'PATH': os.environ['PATH'], 'SLURM_JOB_ID': 'old'}}, 'cwd': {str(tmp_path)!r}}}))")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": os.environ["PATH"], "PYTHONPATH": SRC}, text=True)


def test_the_real_srun_runs_outside_with_the_stand_ins_argv_and_stdio_and_its_exit_code_comes_back(tmp_path):
    """The stand-in's argv (after argv[0]), its stdout and directory reach the real srun, which gets a step
    token and the wrapper's own SLURM_* values; its socket is registered with the agent; the stand-in exits
    with the real srun's code."""
    os.environ["SLURM_JOB_ID"] = "new"
    r = Relay(tmp_path, 'echo "args $* token $SLURMCKPT_STEP_TOKEN job $SLURM_JOB_ID cwd $(pwd)"; exit 3\n')
    p = r.standin(["srun", "-N1", "orted", "-mca", "x"], tmp_path)
    out, err = p.communicate(timeout=30)
    r.stop = True
    assert p.returncode == 3, err
    m = re.fullmatch(r"args -N1 orted -mca x token ([0-9a-f]{16}) job new cwd (\S+)\n", out)
    assert m and m.group(2) == str(tmp_path), out
    assert r.calls == [("srun_standin", 1)] and r.relay.sessions == {}


def test_a_signal_to_the_stand_in_reaches_the_real_srun_and_the_stand_in_dies_of_it(tmp_path):
    """mpirun ending its srun with SIGTERM: the real srun gets it, and the stand-in ends by the same signal."""
    marker = tmp_path / "got-term"
    r = Relay(tmp_path, f"trap 'touch {marker}; kill $!; exit 143' TERM\nsleep 30 & wait\n")
    p = r.standin(["srun", "orted"], tmp_path)
    deadline = time.monotonic() + 20
    while not r.relay.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    r.stop = True
    assert marker.exists() and p.returncode in (143, -signal.SIGTERM)


def test_a_restored_stand_in_is_asked_to_resend_and_keeps_its_token(tmp_path):
    """After a restore the relay speaks first (resend); the request's token is kept, so the new step finds the
    old step's images; the exit code then reaches the stand-in as before."""
    r = Relay(tmp_path, 'echo "$SLURMCKPT_STEP_TOKEN" > token; exit 0\n')
    ours, theirs = socket.socketpair()
    r.relay.adopt(ours)
    chan = Channel(theirs)
    assert chan.recv()[0] == {"resend": True}
    chan.send({"argv": ["srun", "orted"], "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path),
               "token": "0123456789abcdef"}, [0, 1, 2, theirs.fileno()])
    assert chan.recv()[0] == {"token": "0123456789abcdef"}
    assert chan.recv()[0] == {"exit": 0}
    r.stop = True
    assert (tmp_path / "token").read_text() == "0123456789abcdef\n"
    assert any("started again" in line for line in r.said)


def test_requests_are_checked_and_their_fds_closed_when_refused(tmp_path):
    """Four fds and well-typed argv, env and cwd, or a ProtocolError with every fd closed; a token that is
    not 16 hex digits is replaced."""
    good = {"argv": ["srun"], "env": {"A": "b"}, "cwd": "/"}
    for bad in ({**good, "argv": []}, {**good, "argv": "srun"}, {**good, "env": {"A": 1}}, {**good, "cwd": 3}):
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]
        with pytest.raises(ProtocolError):
            request_of(bad, fds)
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
    with pytest.raises(ProtocolError):
        request_of(good, fds)
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]
    assert re.fullmatch(r"[0-9a-f]{16}", request_of({**good, "token": "../../x"}, fds)[3])
    for fd in fds:
        os.close(fd)


@pytest.mark.system
def test_another_user_cannot_have_the_relay_run_anything(tmp_path):
    """A process of another uid that connects to the relay is closed on before a byte is read: nothing runs
    and nothing is registered with the agent."""
    assert os.geteuid() == 0, "run as root: the attacker is a forked child that drops to uid 65534"
    r = Relay(tmp_path, f"touch {tmp_path}/ran\n", where=open_dir(tmp_path))   # the uid check, in depth:
    os.chmod(r.relay.name, 0o777)                                   # a socket in a directory it may enter
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(r.relay.name)
            try:
                Channel(s).send({"argv": ["srun"], "env": {}, "cwd": "/"}, [0, 1, 2, s.fileno()])
                os._exit(0 if s.recv(1) == b"" else 1)      # closed on us, nothing answered
            except (BrokenPipeError, ConnectionResetError):
                os._exit(0)                                  # closed before the request was even sent
        except BaseException:
            os._exit(2)
    _, raw = os.waitpid(pid, 0)
    r.stop = True
    assert os.waitstatus_to_exitcode(raw) == 0
    time.sleep(0.2)
    assert not (tmp_path / "ran").exists() and r.calls == []


def open_dir(tmp_path: Path) -> Path:
    """A directory every uid may enter (pytest's tmp_path is root's 0700), removed with the test's."""
    d = Path(tempfile.mkdtemp(prefix="slurmckpt-test-"))
    d.chmod(0o755)
    (tmp_path / "open-dir").symlink_to(d)
    atexit.register(shutil.rmtree, d, True)
    return d


JOB_UID, OTHER_UID, JOB = 60001, 60002, 4242


def as_user(uid: int, act) -> list:
    """`act()` in a child that runs as `uid`: what it returned (a list of short results)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(act()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def errno_of(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))


@pytest.mark.system
def test_no_other_user_can_take_or_reach_a_jobs_relay_path(tmp_path):
    """The relay's path (`<run_dir>/srun-relay/<uid>/<job>`, the same after a requeue) is in a directory root makes
    for the job's user, 0700, inside root's 0755 `<run_dir>/srun-relay`: another user can create neither that
    directory (before root does: the next user's) nor a socket in it, nor connect there. The job's user
    binds there; a directory left with another owner or mode is given back to the user, 0700."""
    assert os.geteuid() == 0, "run as root: the users are forked children"
    run = open_dir(tmp_path) / "run"
    where = relay_dir(str(run), JOB_UID, JOB_UID)
    st = os.lstat(where)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (JOB_UID, JOB_UID, 0o700)
    assert (os.lstat(run / "srun-relay").st_uid, stat.S_IMODE(os.lstat(run / "srun-relay").st_mode)) == (0, 0o755)
    path = os.path.join(where, str(JOB))

    def squat() -> list:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        return [errno_of(lambda: s.bind(path)), errno_of(lambda: os.mkdir(run / "srun-relay" / str(JOB_UID + 5))),
                errno_of(lambda: s.connect(path))]
    assert as_user(OTHER_UID, squat) == ["EACCES", "EACCES", "EACCES"]

    def serve() -> list:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        return [os.lstat(path).st_uid]
    assert as_user(JOB_UID, serve) == [JOB_UID]
    assert as_user(OTHER_UID, squat)[2] == "EACCES"          # bound by the user now: still out of reach
    os.chown(where, OTHER_UID, OTHER_UID)
    os.chmod(where, 0o777)
    assert relay_dir(str(run), JOB_UID, JOB_UID) == where
    st = os.lstat(where)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (JOB_UID, 0o700)
    os.symlink("/etc", run / "srun-relay" / str(OTHER_UID))
    with pytest.raises(PermissionDenied, match="not a directory"):
        relay_dir(str(run), OTHER_UID, OTHER_UID)


def test_the_relay_starts_only_in_a_directory_of_its_own_and_replaces_a_stale_socket(tmp_path, monkeypatch):
    """The wrapper binds only where the directory is its own and closed to others; a socket file an earlier
    start left (nobody listens) is replaced, one still served is not taken over; the stand-in connects only
    to a path (an abstract name anyone may have bound is refused)."""
    standin = Path(install(str(tmp_path / "standin"), sys.executable)).parent
    (tmp_path / "open").mkdir(mode=0o755)
    (tmp_path / "open").chmod(0o755)
    assert SrunRelay.start(str(tmp_path / "open" / "r"), str(standin), lambda *a, **k: {}, print) is None
    assert SrunRelay.start(None, str(standin), lambda *a, **k: {}, print) is None
    (tmp_path / "own").mkdir(mode=0o700)
    path = str(tmp_path / "own" / "r")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()                                     # the file stays, no one listens
    relay = SrunRelay.start(path, str(standin), lambda *a, **k: {}, print)
    assert relay is not None and stat.S_ISSOCK(os.lstat(path).st_mode)
    assert connect(path).close() is None              # served by our uid
    monkeypatch.setattr(time, "sleep", lambda s: None)
    assert SrunRelay.start(path, str(standin), lambda *a, **k: {}, print) is None    # still served: not taken
    relay.close()
    assert not os.path.exists(path)
    with pytest.raises(ConnectionRefusedError, match="no socket path"):
        connect("slurmckpt-srun-4242-1001")


def test_a_stand_in_without_a_known_real_srun_says_so_and_never_runs_itself(tmp_path, monkeypatch):
    """An srun the stand-in does not relay is the real one (exec); with no real srun known it exits with a
    message instead of looking itself up in PATH again."""
    with pytest.raises(SystemExit, match="the real srun is not known"):
        exec_real(["srun", "x"], {RELAY: "n", "PATH": str(tmp_path)})
    assert STEP_TOKEN == "SLURMCKPT_STEP_TOKEN"


def test_the_installed_script_relays_only_under_an_mpi_launcher(tmp_path):
    """The `srun` that install() writes: under a parent whose executable is named mpirun it starts the Python
    stand-in, whose request reaches the relay (the relay's srun ran, its exit code came back); under any
    other parent it execs the real srun directly, without the stand-in's variables."""
    script = install(str(tmp_path / "standin"), sys.executable)
    r = Relay(tmp_path, f"touch {tmp_path}/relayed; exit 5\n")
    launcher = tmp_path / "mpirun"
    shutil.copy("/bin/sh", launcher)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": SRC, RELAY: r.relay.name, REAL_SRUN: "/usr/bin/env"}
    p = subprocess.run([str(launcher), "-c", f"{script} -N1 orted; echo rc=$?"], env=env, capture_output=True,
                       text=True, timeout=60)
    r.stop = True
    assert p.stdout == "rc=5\n" and (tmp_path / "relayed").exists(), p
    p = subprocess.run(["/bin/bash", "-c", f"{script}; echo rc=$?"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.stdout.endswith("rc=0\n") and RELAY not in p.stdout and REAL_SRUN not in p.stdout, p
    assert f"PATH={os.environ['PATH']}" in p.stdout          # /usr/bin/env ran, as the real srun
    with pytest.raises(ValueError):
        install(str(tmp_path / "x"), "python3; rm -rf /")
