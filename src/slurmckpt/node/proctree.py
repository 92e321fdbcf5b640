"""What a capture makes of a live process tree (read through procfs.py): its processes, the files it holds
and writes, its TCP connections."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import AbstractSet, Iterable

from slurmckpt.node import procfs


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid in procfs.pids():
        try:
            ppid = procfs.stat(pid).ppid
        except OSError:
            continue
        kids.setdefault(ppid, []).append(pid)
    return kids


def descendants(root: int, include_root: bool = True) -> list[int]:
    kids = children_map()
    out, todo = ([root] if include_root else []), [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def parent_of(pid: int) -> int:
    return procfs.stat(pid).ppid


def is_descendant(pid: int, ancestor: int) -> bool:
    try:
        while pid > 1:
            if pid == ancestor:
                return True
            pid = parent_of(pid)
    except OSError:
        return False
    return pid == ancestor


def uid_of(pid: int) -> int:
    return procfs.uid(pid)


def exe_name(pid: int) -> str:
    return os.path.basename(procfs.exe(pid))


@dataclass(frozen=True)
class FdTarget:
    """What one fd refers to, in the form criu's --inherit-fd wants."""
    fd: int
    link: str          # readlink of /proc/pid/fd/N
    regular: bool
    size: int
    writable: bool
    dev: int = 0
    ino: int = 0
    path_only: bool = False      # an O_PATH descriptor: it grants neither read nor write
    mnt_id: int = 0              # the mount it was opened through (fdinfo)

    @property
    def criu_key(self) -> str:
        return self.link.lstrip("/") if self.link.startswith("/") else self.link


@dataclass(frozen=True)
class MountView:
    """The mounts of a tree that has a mount namespace of its own (GPU tasks: launch.py), None for one in
    the node's. A file the tree holds through a mount outside its namespace (Slurm's output files and
    /dev/null, opened by slurmstepd) is not in criu's view of the tree's mounts: it is dumped as external
    (`file[MNT:INO]`, hex) and handed in again at the restore under that key."""
    inside: frozenset[int] | None = None

    def key(self, t: FdTarget) -> str:
        """criu's key for the file behind `t`: its path, or its external id when it lies outside."""
        if self.inside is not None and t.link.startswith("/") and not t.link.startswith("/memfd:") \
                and t.mnt_id not in self.inside:
            return f"file[{t.mnt_id:x}:{t.ino:x}]"
        return t.criu_key


def mount_view(root_pid: int) -> MountView:
    """How criu will see the mounts of the tree rooted at `root_pid` (see MountView)."""
    if procfs.namespace(root_pid, "mnt") == procfs.namespace("self", "mnt"):
        return MountView()
    return MountView(frozenset(int(line.split()[0]) for line in procfs.mountinfo(root_pid) if line.strip()))


def fd_target(pid: int, fd: int) -> FdTarget | None:
    try:
        link = procfs.fd_link(pid, fd)
        st = procfs.fd_stat(pid, fd)
        info = procfs.fdinfo(pid, fd)
        flags = int(info["flags"], 8)
        mnt_id = int(info.get("mnt_id", 0))
    except (OSError, KeyError, ValueError):
        return None
    return FdTarget(fd, link, stat.S_ISREG(st.st_mode), st.st_size, (flags & os.O_ACCMODE) != os.O_RDONLY,
                    st.st_dev, st.st_ino, bool(flags & O_PATH), mnt_id)


O_PATH = 0o10000000


def fd_position(pid: int, fd: int) -> int:
    try:
        return int(procfs.fdinfo(pid, fd)["pos"])
    except (OSError, KeyError, ValueError):
        return 0


def open_files(pid: int) -> list[FdTarget]:
    return [t for fd in procfs.fds(pid) if (t := fd_target(pid, fd))]


def written_files(pids: list[int], exclude: set[str]) -> dict[str, FdTarget]:
    """Regular files open for writing anywhere in the tree: path -> what the fd names now (the tree is
    frozen)."""
    out: dict[str, FdTarget] = {}
    for pid in pids:
        for t in open_files(pid):
            if t.regular and t.writable and t.link.startswith("/") and t.link not in exclude \
                    and not t.link.endswith(" (deleted)"):
                out[t.link] = t
    return out


@dataclass(frozen=True)
class DeletedFile:
    """A regular file the tree holds open or mapped after it was unlinked: criu copies its contents into the
    images (a "ghost file"), and refuses any bigger than its --ghost-limit."""
    path: str          # the name it had, without " (deleted)"
    size: int
    pid: int           # one process holding it
    how: str           # "open" (an fd) or "mapped" (a mapping, /proc/PID/map_files)


# Deleted files criu dumps by other means, not as ghost files: memfd (own image), shared anonymous memory
# (shown as /dev/zero), SysV segments.
_NOT_GHOSTS = ("/memfd:", "/dev/zero", "/SYSV")


def _held_by_removed_names(pids: list[int]) -> Iterable[tuple[DeletedFile, os.stat_result]]:
    """Every regular file `pids` hold open or mapped by a name that was removed (" (deleted)"), with its
    inode's stat: read through the fd or map_files link, never by path."""
    for pid in pids:
        for kind, folder, names in (("open", "fd", procfs.fds(pid)), ("mapped", "map_files", procfs.map_files(pid))):
            for name in names:
                link_path = procfs.path(pid, folder, name)
                try:
                    link = os.readlink(link_path)
                    if not link.endswith(" (deleted)") or link.startswith(_NOT_GHOSTS):
                        continue
                    st = os.stat(link_path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield DeletedFile(link[:-len(" (deleted)")], st.st_size, pid, kind), st


def deleted_files(pids: list[int]) -> list[DeletedFile]:
    """Every unlinked regular file `pids` hold, once per inode, biggest first. Sizes are read from the
    inode itself (stat through the fd or map_files link), never by path."""
    found: dict[tuple[int, int], DeletedFile] = {}
    for f, st in _held_by_removed_names(pids):
        if st.st_nlink == 0 and (st.st_dev, st.st_ino) not in found:
            found[(st.st_dev, st.st_ino)] = f
    return sorted(found.values(), key=lambda f: (-f.size, f.path))


def relinked_files(pids: list[int], except_dev: int) -> list[DeletedFile]:
    """Every regular file `pids` hold by a removed name while another name of it remains (nlink > 0), on
    any file system but `except_dev`'s, once per (inode, removed name). criu dumps such a file only by making
    a new name for it in the removed name's directory (--link-remap)."""
    found: dict[tuple[int, int, str], DeletedFile] = {}
    for f, st in _held_by_removed_names(pids):
        if st.st_nlink > 0 and st.st_dev != except_dev:
            found.setdefault((st.st_dev, st.st_ino, f.path), f)
    return sorted(found.values(), key=lambda f: f.path)


IO_URING = "anon_inode:[io_uring]"
# Libraries known to create io_uring instances on their own, by a part of their mapped path
IO_URING_MAKERS = (("libtorch", "PyTorch's TCPStore (torch.distributed) through libuv, unless USE_LIBUV=0"),
                   ("libuv", "libuv >= 1.45"), ("liburing", "liburing"))


def io_uring_holders(pids: list[int]) -> list[str]:
    """One line for every process of `pids` holding an io_uring instance, which criu cannot checkpoint:
    its pid, name and executable, and the libraries it maps that are known to make one."""
    out = []
    for pid in pids:
        if IO_URING not in procfs.fd_links(pid):
            continue
        mapped = {parts[5] for parts in procfs.maps(pid) if len(parts) == 6}
        makers = [what for part, what in IO_URING_MAKERS if any(part in os.path.basename(m) for m in mapped)]
        try:
            name = procfs.comm(pid)
        except OSError:
            continue                    # gone
        out.append(f"pid {pid} ({name}, {procfs.exe(pid) or '?'}) holds an io_uring instance"
                   + (f" (made by {' or '.join(makers)})" if makers else ""))
    return out


def has_slurm_client(pids: list[int]) -> bool:
    """A running srun in the tree: its connections to Slurm cannot be restored, so the tree is replayed."""
    return any(exe_name(p) in ("srun", "sattach") for p in pids)


def _hex_addr(text: str) -> tuple[str, int]:
    import ipaddress
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1])), int(port, 16)
    # /proc prints IPv6 as four little-endian 32-bit words
    addr = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(addr.ipv4_mapped or addr), int(port, 16)


def socket_inodes(pids: Iterable[int]) -> set[str]:
    """Inode numbers (as /proc/net/* prints them) of every socket the processes hold open."""
    return {link[8:-1] for pid in pids for link in procfs.fd_links(pid) if link.startswith("socket:[")}


@dataclass(frozen=True)
class TcpConnection:
    local: str           # "address:port"
    remote: str
    remote_ip: str
    inode: int           # socket inode (criu --tcp-close-ino names the connection by it)
    accepted: bool       # the tree accepted it on a port it listens on

    def __str__(self) -> str:
        return f"{self.local} -> {self.remote}"


def outside_tcp(pids: list[int], inside: AbstractSet[str] = frozenset()) -> list[TcpConnection]:
    """Established TCP connections of the tree whose other end is not the job's on this node: not loopback,
    and not a socket of this network namespace held by the tree itself or by `inside` (socket inodes of the
    job's other trees on this node; MPI daemons talk over the node's own address). Both ends of the others
    are frozen at the barrier and dumped as they are; these have an end that goes on without the job (a
    client on a login node, a database), so they are dumped and restored closed (rank/capture.py, rank/restore.py)."""
    import ipaddress
    inodes = socket_inodes(pids)
    if not inodes or not pids:
        return []
    table = tcp_table(pids[0])
    rows = [f for f in table if f[9] in inodes]
    listening = {_hex_addr(f[1])[1] for f in rows if f[3] == "0A"}          # 0A = LISTEN
    ends = inodes | set(inside)
    held = {(f[1], f[2]) for f in table if f[3] == "01" and f[9] in ends}
    found = []
    for f in rows:
        if f[3] != "01":                                                   # 01 = ESTABLISHED
            continue
        local, remote = _hex_addr(f[1]), _hex_addr(f[2])
        if ipaddress.ip_address(remote[0]).is_loopback or (f[2], f[1]) in held:
            continue
        found.append(TcpConnection(f"{local[0]}:{local[1]}", f"{remote[0]}:{remote[1]}", remote[0], int(f[9]),
                                   local[1] in listening))
    return found


def tcp_table(pid: int) -> list[list[str]]:
    """The TCP sockets of the network namespace of `pid` (/proc/PID/net/tcp and tcp6), one field list each."""
    return [f for table in ("tcp", "tcp6") for f in procfs.net_table(pid, table) if len(f) > 9]


def local_addresses(fib_trie: str | None = None) -> set[str]:
    """The IPv4 addresses of this network namespace (a Slurm node may be a namespace of a shared host), from
    /proc/self/net/fib_trie (or the text given)."""
    lines = (procfs.fib_trie() if fib_trie is None else fib_trie).splitlines()
    return {lines[i - 1].split()[-1] for i, line in enumerate(lines)
            if i and line.strip() == "/32 host LOCAL" and lines[i - 1].strip().startswith("|--")}
