"""Every read of /proc, in one place, below one root that tests point at a tree of their own (`rooted`).

Reads return what the kernel says, parsed no further than the file's own format; what a capture makes of it
lives in proctree.py, ipc.py, task_cgroup.py and cuda/procscan.py. A process that vanished between two reads
raises OSError like the file operation would (callers decide what a vanished process means), except where a
function says it returns an empty value instead.

Paths through /proc that are *opened* rather than read (an fd link reopened as the job's user, a mapping
read through map_files) are built by `path`, so they follow the same root.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_root = Path("/proc")


def root() -> Path:
    return _root


@contextmanager
def rooted(path: Path | str) -> Iterator[Path]:
    """Read a fake /proc below `path` inside the block (tests)."""
    global _root
    saved, _root = _root, Path(path)
    try:
        yield _root
    finally:
        _root = saved


def path(pid: int | str, *parts: str | int) -> Path:
    return _root.joinpath(str(pid), *(str(p) for p in parts))


def _text(pid: int | str, *parts: str) -> str:
    with open(path(pid, *parts)) as f:
        return f.read()


# ---- processes --------------------------------------------------------------------------------------------
def pids() -> list[int]:
    return [int(e) for e in os.listdir(_root) if e.isdigit()]


def exists(pid: int) -> bool:
    return path(pid).exists()


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/PID/stat that slurmckpt uses."""
    comm: str
    state: str
    ppid: int
    utime: int        # clock ticks
    stime: int
    flags: int = 0    # the kernel's PF_* flags of the task


PF_EXITING = 0x4      # include/linux/sched.h: the task is in do_exit() (or done with it: a zombie)


def stat(pid: int) -> Stat:
    data = _text(pid, "stat")
    comm = data[data.index("(") + 1:data.rindex(")")]
    fields = data.rsplit(")", 1)[1].split()
    return Stat(comm, fields[0], int(fields[1]), int(fields[11]), int(fields[12]), int(fields[6]))


def ended(pid: int) -> bool:
    """The process is gone, or every thread of it is in the kernel's exit or done with it (the cgroup freezer
    no longer holds such a process). A leader that left by pthread_exit while other threads run is not."""
    try:
        for tid in threads(pid):
            try:
                if not stat(tid).flags & PF_EXITING:
                    return False
            except OSError:      # a thread that just ended
                continue
    except OSError:
        return True
    return True


def comm(pid: int) -> str:
    """The process's name as the kernel keeps it (15 bytes at most)."""
    return _text(pid, "comm").rstrip("\n")


def char_device_majors(prefix: str, devices: str | None = None) -> list[int]:
    """Major numbers of the character devices whose driver name starts with `prefix` (/proc/devices)."""
    if devices is None:
        try:
            devices = (_root / "devices").read_text()
        except OSError:
            return []
    text = devices
    chars = text.split("Block devices:")[0]
    return sorted({int(m) for m, name in (l.split(None, 1) for l in chars.splitlines()[1:] if len(l.split()) == 2)
                   if name.strip().startswith(prefix)})


def thread_comm(pid: int, tid: int) -> str:
    """A thread's name (15 bytes at most): the name a library gave it, or its process's."""
    return _text(pid, "task", str(tid), "comm").rstrip("\n")


def status(pid: int | str) -> dict[str, list[str]]:
    """/proc/PID/status as name -> whitespace-separated values."""
    out = {}
    for line in _text(pid, "status").splitlines():
        name, sep, value = line.partition(":")
        if sep:
            out[name] = value.split()
    return out


def uid(pid: int) -> int:
    """The owner of /proc/PID (the process's effective uid at its last exec/setuid)."""
    return os.stat(path(pid)).st_uid


def environ(pid: int) -> dict[str, str]:
    """The process's initial environment; {} if it cannot be read."""
    try:
        with open(path(pid, "environ"), "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def exe(pid: int) -> str:
    """readlink of /proc/PID/exe; "" if it cannot be read."""
    try:
        return os.readlink(path(pid, "exe"))
    except OSError:
        return ""


def cgroups(pid: int | str) -> list[tuple[str, str, str]]:
    """(hierarchy id, controllers, path) of each line of /proc/PID/cgroup ("0", "", path for cgroup v2)."""
    out = []
    for line in _text(pid, "cgroup").splitlines():
        hier, controllers, cpath = line.split(":", 2)
        out.append((hier, controllers, cpath))
    return out


def cgroup_v2(pid: int | str) -> str | None:
    """The process's cgroup v2 path, None without one."""
    return next((p for h, c, p in cgroups(pid) if h == "0" and not c), None)


def mountinfo(pid: int | str = "self") -> list[str]:
    return _text(pid, "mountinfo").splitlines()


def namespace(pid: int | str, kind: str) -> int:
    """Inode of the process's namespace of `kind` (net, pid, mnt...)."""
    return os.stat(path(pid, "ns", kind)).st_ino


def namespace_link(pid: int | str, kind: str) -> int:
    """The same inode from the link's text (`user:[4026531837]`), which needs no access to the namespace."""
    text = os.readlink(path(pid, "ns", kind))
    return int(text[text.index("[") + 1:text.rindex("]")])


def cmdline(pid: int | str) -> list[str]:
    """The process's argv; [] for a kernel thread or a process that is gone."""
    try:
        with open(path(pid, "cmdline"), errors="replace") as f:
            return f.read().split("\0")[:-1]
    except OSError:
        return []



def threads(pid: int) -> list[int]:
    """The process's thread ids; [] if it is gone."""
    try:
        return [int(n) for n in os.listdir(path(pid, "task"))]
    except OSError:
        return []


def blocked_syscall(pid: int, tid: int) -> tuple[int, list[int]] | None:
    """(syscall number, its six arguments) the thread is blocked in, from /proc/PID/task/TID/syscall; None
    when it runs, is not in a syscall, or is gone. A thread stopped by the freezer still shows the syscall
    it sleeps in (checked on cgroup v1 and v2)."""
    try:
        fields = _text(pid, "task", str(tid), "syscall").split()
    except OSError:
        return None
    if len(fields) < 7 or not fields[0].lstrip("-").isdigit() or int(fields[0]) < 0:
        return None                       # "running", or -1 (not in a syscall)
    return int(fields[0]), [int(a, 16) for a in fields[1:7]]

# ---- file descriptors and mappings -------------------------------------------------------------------------
def fds(pid: int) -> list[int]:
    """The process's open fd numbers; [] if it is gone."""
    try:
        return [int(n) for n in os.listdir(path(pid, "fd"))]
    except OSError:
        return []


def fd_link(pid: int, fd: int) -> str:
    return os.readlink(path(pid, "fd", fd))


def fd_stat(pid: int, fd: int) -> os.stat_result:
    """stat of what the fd refers to (the inode itself, not a path)."""
    return os.stat(path(pid, "fd", fd))


def fdinfo(pid: int, fd: int) -> dict[str, str]:
    out = {}
    for line in _text(pid, "fdinfo", str(fd)).splitlines():
        name, sep, value = line.partition(":")
        if sep:
            out[name] = value.strip()
    return out


def fd_links(pid: int) -> list[str]:
    """readlink of every fd; [] if the process is gone."""
    out = []
    for fd in fds(pid):
        try:
            out.append(fd_link(pid, fd))
        except OSError:
            pass
    return out


def maps(pid: int) -> list[list[str]]:
    """/proc/PID/maps split into at most 6 fields a line; [] if the process is gone."""
    try:
        return [line.split(maxsplit=5) for line in _text(pid, "maps").splitlines()]
    except OSError:
        return []


def map_files(pid: int) -> list[str]:
    """The address-range names under /proc/PID/map_files; [] if they cannot be listed."""
    try:
        return os.listdir(path(pid, "map_files"))
    except OSError:
        return []


# ---- network namespace of a process ------------------------------------------------------------------------
def net_table(pid: int | str, table: str) -> list[list[str]]:
    """Rows of /proc/PID/net/<table> (tcp, tcp6, unix...) split on whitespace, header dropped; [] if absent."""
    try:
        lines = _text(pid, "net", table).splitlines()[1:]
    except OSError:
        return []
    return [line.split() for line in lines]


def fib_trie(pid: int | str = "self") -> str:
    """/proc/PID/net/fib_trie: the IPv4 addresses of the process's network namespace; "" if absent."""
    try:
        return _text(pid, "net", "fib_trie")
    except OSError:
        return ""


# ---- the kernel --------------------------------------------------------------------------------------------
def kernel_has(name: str) -> bool:
    """/proc/sys/kernel/<name> exists (e.g. ns_last_pid: checkpoint/restore support)."""
    return (_root / "sys" / "kernel" / name).exists()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (its kB values times 1024; counters without a unit as they are)."""
    out = {}
    with open(_root / "meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def vm_setting(name: str) -> int:
    """/proc/sys/vm/<name> as a number (e.g. dirty_ratio, dirty_bytes)."""
    return int((_root / "sys" / "vm" / name).read_text().split()[0])
