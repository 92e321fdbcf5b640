"""Start a task's command as a checkpointable tree: own PID namespace and session, job user's credentials.

Done by the root agent because an unprivileged wrapper cannot create a PID namespace without a user
namespace (which CRIU would then have to restore too). Credentials and limits are read from the wrapper
process itself (Slurm set them; a process can only lower its own), never from the request.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import re
import resource
import stat
import sys
from dataclasses import dataclass

from slurmckpt.node import procfs
from slurmckpt.errors import PermissionDenied, SlurmckptError
from slurmckpt.node.task_cgroup import TaskCgroup

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x40000, 0x80000
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


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare_namespaces(own_mntns: bool) -> None:
    """A new PID namespace for the children of the caller and, with `own_mntns`, a mount namespace of its
    own: a slave copy of the node's (mounts made on the node later still appear in it, none of its own
    leave it), where the tree's init mounts its own /proc."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWPID | (CLONE_NEWNS if own_mntns else 0)), "unshare")
    if own_mntns:
        # A copy of a mount that is only a slave where the agent runs (a node or job namespace below the
        # host's: job_container/tmpfs, the test cluster) would be the slave of a peer group criu cannot
        # see from here ("has unreachable sharing"): those copies are made private. The others become
        # slaves of the agent's shared mounts, which criu can see.
        for target in slave_only_mount_points(procfs.mountinfo("self")):
            libc.mount(None, os.fsencode(target), None, MS_PRIVATE, None)    # best effort: the dump says
        _check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")


def slave_only_mount_points(mountinfo: list[str]) -> list[str]:
    """Mount points of `mountinfo` lines (proc(5)) that receive propagation from a master but share with
    no peer group of their own."""
    out = []
    for line in mountinfo:
        fields = line.split()
        if "-" not in fields or len(fields) < 7:
            continue
        optional = fields[6:fields.index("-")]
        if any(o.startswith("master:") for o in optional) and not any(o.startswith("shared:") for o in optional):
            out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return out


def mount_own_proc() -> None:
    """In PID 1 of the new namespaces: /proc shows this PID namespace (CUDA reads /proc/<its own pid>)."""
    _check(_libc().mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")


def append_only(fds: list[int]) -> None:
    """Regular files among `fds` (Slurm's output files) written in append mode: criu then checks no size
    when it reopens them through the fds a restore hands in (the file grew since the capture)."""
    for fd in fds:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            continue


def spawn_tree(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], creds: Credentials,
               init_path: str, cgroup: TaskCgroup, home: str, own_mntns: bool = False,
               block_io_uring: bool = False) -> int:
    """Fork an intermediate that joins the task cgroup and a new PID namespace (and, with `own_mntns`, a
    mount namespace: GPU tasks), whose child (PID 1 there) becomes the job user and execs the init. The
    intermediate exits, so the init re-parents to the nearest subreaper: the wrapper. With `block_io_uring`
    the workload runs under init's io_uring filter (docs/gpu.md, "io_uring"). Returns the init's host PID."""
    rfd, wfd = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(rfd)
            cgroup.add(os.getpid())
            unshare_namespaces(own_mntns)
            init_pid = os.fork()
            if init_pid == 0:
                _become_task(argv, env, cwd, stdio, creds, init_path, home, own_mntns,   # never returns
                             block_io_uring)
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


def relay_dir(run_dir: str, uid: int, gid: int) -> str:
    """`<run_dir>/srun-relay/<uid>`: where the user's batch wrappers serve their srun relays (srun_relay.py).
    Made by root in root's 0755 `<run_dir>/srun-relay`, so no other user can create it first or put anything in
    it; the user's own, mode 0700, so only the user binds, connects or removes there. An entry already there
    (a file or a symlink can only be root's) that is no directory is refused, never followed."""
    os.makedirs(run_dir, mode=0o755, exist_ok=True)
    _require_root_dir(run_dir)
    parent = os.path.join(run_dir, "srun-relay")
    try:
        os.mkdir(parent, 0o755)
    except FileExistsError:
        pass
    _require_root_dir(parent, fix=True)
    path = os.path.join(parent, str(uid))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied("not a directory (refusing a symlink or file)", path=path)
    if st.st_uid != uid or st.st_gid != gid:
        os.chown(path, uid, gid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700, follow_symlinks=False)
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
                 env_fd: int, block_io_uring: bool = False) -> list[str]:
    """The job's user. The init alone also holds CAP_SYS_ADMIN and CAP_DAC_OVERRIDE (ambient; its child
    drops every capability before exec): CRIU's parasite needs them in a PID namespace's init to mount that
    namespace's /proc in the root-owned home. The child installs the io_uring filter with CAP_SYS_ADMIN."""
    groups = ",".join(str(g) for g in creds.groups)
    caps = "-all,+sys_admin,+dac_override"
    return [SETPRIV, f"--reuid={creds.uid}", f"--regid={creds.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
            f"--inh-caps={caps}", f"--ambient-caps={caps}",
            init_path, "--chdir", home, "--workdir", cwd, "--env-fd", str(env_fd),
            *(["--block-io-uring"] if block_io_uring else []), "--", *argv]


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


def _become_task(argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], creds: Credentials, init_path: str,
                 home: str, own_mntns: bool, block_io_uring: bool) -> None:
    """In the forked child (root): session, stdio, limits, then exec setpriv -> init with a fixed
    environment. The user's cwd and environment are handed to init's child, which uses them without
    privileges; root never chdirs into the user's directory."""
    try:
        os.setsid()
        if own_mntns:
            mount_own_proc()
            append_only(stdio[:3])
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
        command = init_command(creds, init_path, argv, home, cwd, ENV_FD, block_io_uring)
        os.execve(command[0], command, PRIVILEGED_ENV)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"slurmckpt: cannot start {argv[0] if argv else '?'}: {e}\n".encode())
        finally:
            os._exit(127)
    sys.exit(127)
