"""Start a task's command as a checkpointable tree: own PID namespace and session, job user's credentials.

Done by the root agent because an unprivileged wrapper cannot create a PID namespace without a user
namespace (which CRIU would then have to restore too). Credentials and limits are read from the wrapper
process itself (Slurm set them; a process can only lower its own), never from the request.
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys
from dataclasses import dataclass

from slurmckpt.errors import PermissionDenied, SlurmckptError
from slurmckpt.freezer import Freezer

CLONE_NEWPID = 0x20000000
_LIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}


@dataclass(frozen=True)
class Credentials:
    uid: int
    gid: int
    groups: tuple[int, ...]
    limits: tuple[tuple[int, int, int], ...]   # (resource, soft, hard)

    @classmethod
    def of_process(cls, pid: int, expect_uid: int) -> "Credentials":
        status = open(f"/proc/{pid}/status").read().splitlines()
        fields = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in status if ":" in line}
        uids = {int(x) for x in fields["Uid"]}
        if uids != {expect_uid}:
            raise PermissionDenied("task process does not run as the job's user", pid=pid, uid=sorted(uids),
                                   job_uid=expect_uid)
        limits = []
        for res in _LIMITS.values():
            try:
                soft, hard = resource.prlimit(pid, res)
            except OSError:
                continue
            limits.append((res, soft, hard))
        return cls(expect_uid, int(fields["Gid"][0]), tuple(int(g) for g in fields.get("Groups", [])),
                   tuple(limits))


def unshare_pid_namespace() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWPID): {os.strerror(err)}")


def spawn_tree(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], creds: Credentials,
               init_path: str, freezer: Freezer, home: str, own_pidns: bool = True) -> int:
    """Fork an intermediate that joins the freezer cgroup and a new PID namespace, whose child (PID 1 there)
    becomes the job user and execs the init. The intermediate exits, so the init re-parents to the nearest
    subreaper: the wrapper. Returns the init's host PID."""
    rfd, wfd = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(rfd)
            freezer.add(os.getpid())
            if own_pidns:
                unshare_pid_namespace()
            init_pid = os.fork()
            if init_pid == 0:
                _become_task(argv, env, cwd, stdio, creds, init_path, home)   # never returns
            os.write(wfd, str(init_pid).encode())
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - report through the pipe, never return into the agent
            os.write(wfd, f"error:{e}".encode())
            os._exit(1)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        answer = r.read().decode()
    os.waitpid(intermediate, 0)
    if not answer or answer.startswith("error:"):
        raise SlurmckptError(f"could not start the task tree: {answer[6:] or 'no answer'}")
    return int(answer)


SETPRIV = "/usr/bin/setpriv"


def init_home(run_dir: str, name: str, creds: Credentials) -> str:
    """The init's private cwd (see slurmckpt_init.c, --chdir): same path on every node and restart, since
    CRIU restores the init's cwd; owned by the job's user, who is the init."""
    os.makedirs(run_dir, mode=0o755, exist_ok=True)
    path = os.path.join(run_dir, name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chown(path, creds.uid, creds.gid)
    return path


def init_command(creds: Credentials, init_path: str, argv: list[str], home: str) -> list[str]:
    """The job's user, plus CAP_SYS_ADMIN for init alone (ambient, cleared by init before it execs the
    workload): CRIU's parasite needs it in a PID namespace's init to open that namespace's /proc."""
    groups = ",".join(str(g) for g in creds.groups)
    return [SETPRIV, f"--reuid={creds.uid}", f"--regid={creds.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
            "--inh-caps=-all,+sys_admin", "--ambient-caps=-all,+sys_admin",
            init_path, "--chdir", home, "--", *argv]


def _become_task(argv, env, cwd, stdio, creds: Credentials, init_path: str, home: str) -> None:
    try:
        os.setsid()
        for target, fd in enumerate(stdio[:3]):
            os.dup2(fd, target, inheritable=True)
        os.closerange(3, 65536)
        for res, soft, hard in creds.limits:
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError):
                pass
        try:
            os.chdir(cwd)
        except OSError as e:
            os.write(2, f"slurmckpt: cannot chdir to {cwd}: {e.strerror}; running in /tmp\n".encode())
            os.chdir("/tmp")
        command = init_command(creds, init_path, argv, home)
        os.execve(command[0], command, env)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"slurmckpt: cannot start {argv[0] if argv else '?'}: {e}\n".encode())
        finally:
            os._exit(127)
    sys.exit(127)
