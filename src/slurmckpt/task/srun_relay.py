"""The batch wrapper's side of the srun stand-in (srun_standin.py; docs/mpi.md, "mpirun starting orted").

An MPI launcher in the batch step runs the stand-in in place of srun; the stand-in asks this relay (in the
wrapper, outside the tree: never frozen, never imaged) to run the real srun with the stand-in's argv,
environment, directory and stdio. The real srun is the wrapper's child, so it is neither dumped nor restored;
the stand-in, which mpirun waits for, is. Each stand-in's socket is registered with the root agent, which
dumps it as external and, at a restore, puts a new socket in its place whose other end comes back here
(`adopt`): the restored stand-in resends its request and the real srun runs again, its step restoring the
old step's images by the token it carries (SLURMCKPT_STEP_TOKEN; agent.py `plan`).

The relay listens on a file system socket whose path the agent gives (`plan`'s `srun_relay`:
`<run_dir>/srun-relay/<uid>/<job>`), the same after a requeue: a restored launcher's environment names it. Its
directory is the user's, 0700, in root's `<run_dir>/srun-relay` (launch.relay_dir): no other user can bind the
name first or connect to it. An abstract name could be neither: every name bound in a network namespace is
listed in /proc/net/unix, and anyone there may bind a free one.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any, Callable

from slurmckpt.channel import Channel
from slurmckpt.errors import ProtocolError, SlurmckptError
from slurmckpt.slurm.control import SRUN, user_srun
from slurmckpt.task.srun_standin import REAL_SRUN, RELAY
from slurmckpt.validate import TOKEN_HEX16

log = logging.getLogger("slurmckpt.srun_relay")

STEP_TOKEN = "SLURMCKPT_STEP_TOKEN"     # in the real srun's environment: its step's name for its checkpoints
Call = Callable[..., dict[str, Any]]


class SrunRelay:
    def __init__(self, path: str, standin_dir: str, call: Call, say: Callable[[str], None]) -> None:
        self.name, self.standin_dir, self.call, self.say = path, standin_dir, call, say
        self.sessions: dict[int, Session] = {}       # real srun pid -> its session
        self.real = user_srun()                     # the task's PATH: the stand-in is not in it
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._bind(path)
            self.listener.listen(16)
            self.inode = os.lstat(path).st_ino
        except OSError:
            self.listener.close()
            raise
        threading.Thread(target=self._accept, daemon=True, name="srun-relay").start()

    def _bind(self, path: str) -> None:
        """A socket left at the path by an earlier start of the job (no one listens: refused) is replaced;
        one still served (that start's wrapper on its way out) raises EADDRINUSE."""
        try:
            self.listener.bind(path)
            return
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)
                self.listener.bind(path)
                return
        raise OSError(errno.EADDRINUSE, "the srun relay is still served by an earlier start", path)

    @classmethod
    def start(cls, path: object, standin_dir: str, call: Call, say: Callable[[str], None]) -> SrunRelay | None:
        """None where no stand-in is installed, the agent gave no path or the path is not in a directory of
        our own that only we can enter (then an MPI launcher's srun is the real one, and such a batch step
        is replayed as before)."""
        if standin_dir == "auto":
            standin_dir = os.path.join(sys.prefix, "libexec", "slurmckpt", "standin")
        if not os.access(os.path.join(standin_dir, SRUN), os.X_OK) or not isinstance(path, str):
            return None
        try:
            st = os.lstat(os.path.dirname(path))
        except OSError as e:
            log.warning("srun relay not started (%s): mpirun's srun runs unrelayed", e)
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("srun relay not started: %s is not a directory only we can enter", os.path.dirname(path))
            return None
        for attempt in range(20):       # the previous start's wrapper may still be on its way out
            try:
                return cls(path, standin_dir, call, say)
            except OSError as e:
                if e.errno != errno.EADDRINUSE or attempt == 19:
                    log.warning("srun relay not started (%s): mpirun's srun runs unrelayed", e)
                    return None
                time.sleep(0.5)
        return None

    def close(self) -> None:
        """The task ends: no more stand-ins; the socket file goes unless a newer start replaced it."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # wakes the accepting thread
        except OSError:
            pass
        self.listener.close()
        try:
            if os.lstat(self.name).st_ino == self.inode:
                os.unlink(self.name)
        except OSError:
            pass

    def tree_env(self, env: dict[str, str]) -> dict[str, str]:
        """The batch tree's environment: the stand-in first in PATH, told where the real srun is."""
        path = env.get("PATH", os.defpath)
        if not self.real or self.standin_dir in path.split(":"):
            return env
        return {**env, "PATH": f"{self.standin_dir}:{path}", RELAY: self.name, REAL_SRUN: self.real}

    def adopt(self, sock: socket.socket) -> None:
        """A restored stand-in's new socket: ask for its request again, then serve it as a new one."""
        Session(self, sock, resend=True).start()

    def reaped(self, pid: int, code: int) -> bool:
        """The wrapper reaped `pid`: True when it was a real srun of ours (its stand-in is told)."""
        with self.lock:
            session = self.sessions.pop(pid, None)
        if session is None:
            return False
        session.ended(code)
        return True

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():        # the job's own processes only
                conn.close()
                continue
            Session(self, conn, resend=False).start()


class Session(threading.Thread):
    """One stand-in: its request, its real srun, the signals and the exit between them."""

    def __init__(self, relay: SrunRelay, sock: socket.socket, resend: bool) -> None:
        super().__init__(daemon=True, name="srun-session")
        self.relay, self.chan, self.resend = relay, Channel(sock), resend
        self.pid = 0
        self.send_lock = threading.Lock()

    def run(self) -> None:
        try:
            if self.resend:
                self._send({"resend": True})
            message, fds = self.chan.recv()
            argv, env, cwd, token = request_of(message, fds)
            try:
                self.relay.call("srun_standin", [fds[3]])     # dumped as external, replaced at a restore
            except SlurmckptError as e:      # srun runs anyway: mpirun must not wait forever for it
                log.warning("stand-in socket not registered (%s): captures of the batch step will refuse it", e)
            finally:
                os.close(fds[3])
            self._send({"token": token})
            env = {**env, STEP_TOKEN: token, **{k: v for k, v in os.environ.items() if k.startswith("SLURM_")}}
            with self.relay.lock:
                self.pid = spawn([self.relay.real, *argv[1:]], env, cwd, fds[:3])
                self.relay.sessions[self.pid] = self
            for fd in fds[:3]:
                os.close(fd)
            if self.resend:
                self.relay.say(f"srun of the restored MPI launcher started again (pid {self.pid}): its step "
                               "restores the daemons it had")
            self._follow()
        except (EOFError, OSError, ProtocolError, SlurmckptError) as e:
            log.warning("srun stand-in session ended: %s", e)

    def _follow(self) -> None:
        """Signals mpirun sent to the stand-in reach the real srun. The stand-in going away (mpirun killed
        it, or a final capture dumped and ended the tree) leaves srun alone: its step ends with the job."""
        while True:
            try:
                message, fds = self.chan.recv()
            except (EOFError, OSError, ProtocolError):
                return
            for fd in fds:
                os.close(fd)
            sig = message.get("signal")
            if isinstance(sig, int) and 0 < sig < 65 and self.pid:
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass

    def ended(self, code: int) -> None:
        self._send({"signal": -code} if code < 0 else {"exit": code})

    def _send(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            try:
                self.chan.send(message)
            except OSError:
                pass


def request_of(message: dict[str, Any], fds: list[int]) -> tuple[list[str], dict[str, str], str, str]:
    """A stand-in's request, checked: argv, environment, directory, its token (a new one if it has none)
    and exactly four fds (stdio and its own socket)."""
    argv, env, cwd, token = message.get("argv"), message.get("env"), message.get("cwd"), message.get("token")
    if len(fds) != 4 or not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
                             and isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in env.items())
                             and isinstance(cwd, str)):
        for fd in fds:
            os.close(fd)
        raise ProtocolError("a stand-in request needs argv, env, cwd and 4 fds")
    if not (isinstance(token, str) and TOKEN_HEX16.fullmatch(token)):
        token = secrets.token_hex(8)
    return argv, env, cwd, token


def spawn(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int]) -> int:
    """fork + exec, not subprocess: the wrapper reaps every child itself (waitpid(-1)) and hands the real
    srun's status to `SrunRelay.reaped`."""
    pid = os.fork()
    if pid == 0:
        try:
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            os.closerange(3, 65536)
            try:
                os.chdir(cwd)
            except OSError:
                os.chdir("/")
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid
