"""Start a task's command as a checkpointable tree: own PID namespace and session, job user's credentials.

Done by the root agent because an unprivileged wrapper cannot create a PID namespace without a user
namespace (which CRIU would then have to restore too). Credentials and limits are read from the wrapper
process itself (Slurm set them; a process can only lower its own), never from the request.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import stat
import sys
from dataclasses import dataclass

from slurmckpt import procfs
from slurmckpt.errors import PermissionDenied, SlurmckptError
from slurmckpt.task_cgroup import TaskCgroup

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
        fields = procfs.status(pid)
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
               init_path: str, cgroup: TaskCgroup, home: str, own_pidns: bool = True) -> int:
    """Fork an intermediate that joins the task cgroup and a new PID namespace, whose child (PID 1 there)
    becomes the job user and execs the init. The intermediate exits, so the init re-parents to the nearest
    subreaper: the wrapper. Returns the init's host PID."""
    rfd, wfd = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(rfd)
            cgroup.add(os.getpid())
            if own_pidns:
                unshare_pid_namespace()
            init_pid = os.fork()
            if init_pid == 0:
                _become_task(argv, env, cwd, stdio, creds, init_path, home, own_pidns)   # never returns
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
# What setpriv and init (both run with privileges) get as their environment: never anything of the user's.
PRIVILEGED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def init_home(run_dir: str, name: str, creds: Credentials) -> str:
    """The init's cwd (see slurmckpt_init.c, --chdir): same path on every node and restart, since CRIU
    restores the init's cwd. Root-owned, 0755: CRIU's parasite mounts a transient proc in it while the
    init holds CAP_SYS_ADMIN, so the user must not be able to rename or replace anything in it
    (docs/security.md). The init creates that mount point with CAP_DAC_OVERRIDE."""
    os.makedirs(run_dir, mode=0o755, exist_ok=True)
    _require_root_dir(run_dir)
    path = os.path.join(run_dir, name)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    _require_root_dir(path, fix=True)
    return path


def _require_root_dir(path: str, fix: bool = False) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied("not a directory (refusing a symlink or file)", path=path)
    if fix and (st.st_uid != 0 or st.st_gid != 0 or stat.S_IMODE(st.st_mode) != 0o755):
        os.chown(path, 0, 0, follow_symlinks=False)      # left by an older release, which gave it the user
        os.chmod(path, 0o755, follow_symlinks=False)
    elif not fix and (st.st_uid != 0 or st.st_mode & 0o022):
        raise PermissionDenied("directory is not root-owned and private", path=path)


def init_command(creds: Credentials, init_path: str, argv: list[str], home: str, cwd: str,
                 env_fd: int, own_pidns: bool) -> list[str]:
    """The job's user. In its own PID namespace the init alone also holds CAP_SYS_ADMIN and
    CAP_DAC_OVERRIDE (ambient; its child drops every capability before exec): CRIU's parasite needs them in
    a PID namespace's init to mount that namespace's /proc in the root-owned home. A tree in the host PID
    namespace needs none."""
    groups = ",".join(str(g) for g in creds.groups)
    caps = "-all,+sys_admin,+dac_override" if own_pidns else "-all"
    return [SETPRIV, f"--reuid={creds.uid}", f"--regid={creds.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
            f"--inh-caps={caps}", f"--ambient-caps={caps}",
            init_path, "--chdir", home, "--workdir", cwd, "--env-fd", str(env_fd), "--", *argv]


def env_memfd(env: dict[str, str]) -> int:
    """The workload's environment as a sealed memfd that init's child reads after every privilege is gone."""
    fd = os.memfd_create("slurmckpt-env", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    data = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items() if "=" not in k and "\0" not in k + v)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
                | fcntl.F_SEAL_SEAL)
    return fd


ENV_FD = 3     # where init finds the workload's environment


def _become_task(argv, env, cwd, stdio, creds: Credentials, init_path: str, home: str, own_pidns: bool) -> None:
    """In the forked child (root): session, stdio, limits, then exec setpriv -> init with a fixed
    environment. The user's cwd and environment are handed to init's child, which uses them without
    privileges; root never chdirs into the user's directory."""
    try:
        os.setsid()
        memfd = env_memfd(env)
        for target, fd in enumerate(stdio[:3]):
            os.dup2(fd, target, inheritable=True)
        os.dup2(memfd, ENV_FD, inheritable=True)
        os.closerange(ENV_FD + 1, 65536)
        for res, soft, hard in creds.limits:
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError):
                pass
        os.chdir("/")
        command = init_command(creds, init_path, argv, home, cwd, ENV_FD, own_pidns)
        os.execve(command[0], command, PRIVILEGED_ENV)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"slurmckpt: cannot start {argv[0] if argv else '?'}: {e}\n".encode())
        finally:
            os._exit(127)
    sys.exit(127)
