"""What a rank's tree shares with processes outside it, and which of it a capture must refuse.

Every rank is its own tree, dumped and restored by its own `criu` run, and the restores of a job's ranks
are not ordered. State one rank shares with another tree is therefore only restorable where CRIU needs
nothing from the other side and nothing is lost while one side is back and the other is not. Measured with
two trees on one node (docs/limitations.md, "State shared between ranks"):

- unix stream/seqpacket socket to a process outside the tree: criu cannot dump one end of a connection
  ("Can't dump half of stream unix connection"); the capture would fail after every rank was frozen.
- unix datagram socket connected to another rank's socket: the restore connect()s it again and fails with
  ECONNREFUSED while that rank is not back yet (two ranks connected to each other can never restore).
- a bound unix datagram socket while another rank holds an unconnected one (sendto by path): datagrams
  sent before the receiving rank is back are refused (ECONNREFUSED), and lost by senders that ignore it.
- a pipe or FIFO open in two trees: the rank restored first sees EOF (reader) or EPIPE (writer) until the
  other is back; a FIFO both ranks hold readable (O_RDWR) has its buffered bytes restored twice.
- a deleted file (unlinked /dev/shm segment, memfd) mapped shared by two trees: each restore gets its own
  private copy of it, so the ranks silently stop sharing memory.
- SysV shared memory: criu dumps it only inside an IPC namespace, which ranks do not have.

Allowed: datagram sockets connected to system daemons (criu reconnects /dev/log and the like by path);
loopback TCP between ranks (held while only one end is back: netlock.py; other hosts: proctree.outside_tcp);
files mapped shared by path, which criu maps again in place: their size and xxh3 are recorded at the capture
and the restore is refused if they changed since (shared_files / check_shared_files below).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any

import xxhash

from slurmckpt.rank.sharing import rendezvous
from slurmckpt.node import procfs
from slurmckpt.node import asuser
from slurmckpt.identity import TreeName
from slurmckpt.errors import PermissionDenied, RestoreError
from slurmckpt.node.launch import Credentials
from slurmckpt.node.sock_diag import UnixSocket, unix_sockets
from slurmckpt.store.jobstore import file_checksum

SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET = socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET
_TYPE: dict[int, str] = {SOCK_STREAM: "stream", SOCK_DGRAM: "datagram", SOCK_SEQPACKET: "seqpacket"}


# ---- what a set of processes holds ---------------------------------------------------------------------
@dataclass
class Holdings:
    """Sockets, pipes and shared file mappings held by a set of processes, each with one holder pid."""
    sockets: dict[int, int] = field(default_factory=dict)                    # inode -> pid
    pipes: dict[tuple[int, int], tuple[int, str]] = field(default_factory=dict)  # (dev, ino) -> (pid, name)
    shared_maps: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)  # (dev, ino) -> (pid, path)


def holdings(pids: list[int], want_pipes: set[tuple[int, int]] | None = None,
             want_maps: set[tuple[str, int]] | None = None) -> Holdings:
    """Read fds and shared mappings of `pids` from /proc. `want_*`: only look those up (None: all)."""
    h = Holdings()
    for pid in pids:
        for fd in procfs.fds(pid):
            try:
                link = procfs.fd_link(pid, fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                h.sockets.setdefault(int(link[8:-1]), pid)
            elif want_pipes != set() and (link.startswith("pipe:[") or link.startswith("/")):
                try:
                    st = procfs.fd_stat(pid, fd)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if stat.S_ISFIFO(st.st_mode) and (want_pipes is None or key in want_pipes):
                    h.pipes.setdefault(key, (pid, link))
        if want_maps != set():
            for mkey, path, _, _ in _mappings(pid):
                if want_maps is None or mkey in want_maps:
                    h.shared_maps.setdefault(mkey, (pid, path))
    return h


def _mappings(pid: int) -> list[tuple[tuple[str, int], str, str, str]]:
    """(dev, inode), path, perms, address range of the file-backed MAP_SHARED mappings of `pid` (perms like
    rw-s), deleted files and SysV segments included."""
    out = []
    for parts in procfs.maps(pid):
        # inode 0 is anonymous shared memory, except for SysV segments: their inode is the shmid (0 is valid,
        # the first segment of an IPC namespace)
        if len(parts) == 6 and parts[1][3:4] == "s" and (parts[4] != "0" or parts[5].startswith("/SYSV")):
            out.append(((parts[3], int(parts[4])), parts[5], parts[1], parts[0]))
    return out


def _linked(path: str) -> bool:
    return not path.endswith(" (deleted)") and not path.startswith("/SYSV")


def job_trees(others: dict[int, TreeName], job: int) -> dict[int, TreeName]:
    """The trees of `others` (task_cgroup.TaskCgroup.other_trees: every checkpointed tree of the node) that
    belong to `job`: a capture's checks look at the job's own trees, so nothing another job (another user)
    does with its processes can make this one's capture fail."""
    return {pid: name for pid, name in others.items() if name.job == job}


# ---- the check -----------------------------------------------------------------------------------------
def unshareable(pids: list[int], others: dict[int, str], inherited: AbstractSet[str] = frozenset(),
                sockets: dict[int, UnixSocket] | None = None) -> list[str]:
    """What the tree `pids` shares that separate dumps and restores cannot bring back (one line each, naming
    the socket, pipe or file and who else holds it). `others`: pid -> label of the other checkpointed
    tasks of the node. `inherited`: fd links (pipe:[N], socket:[N]) the restore hands in itself: the
    task's stdio, which each rank's restore gets from its own new task (--inherit-fd)."""
    ours = holdings(pids)
    problems = _sysv(ours)
    deleted = {k for k, (_, path) in ours.shared_maps.items()
               if path.endswith(" (deleted)") and not path.startswith("/SYSV")}
    if not (ours.sockets or ours.pipes or deleted):
        return problems
    theirs = holdings(list(others), want_pipes=set(ours.pipes), want_maps=deleted)

    def owner(pid: int) -> str:
        return others.get(pid, f"pid {pid}")

    for key, (pid, name) in ours.pipes.items():
        if key in theirs.pipes and name not in inherited:
            what = f"named pipe {name}" if name.startswith("/") else f"pipe {name}"
            problems.append(f"{what} is also open in {owner(theirs.pipes[key][0])}: ranks are restored "
                            "separately, and the one back first would read EOF or get EPIPE")
    for mkey in deleted:
        path = ours.shared_maps[mkey][1]
        if mkey in theirs.shared_maps:
            hint = " (NCCL's shared-memory transport: set NCCL_SHM_DISABLE=1)" if "/dev/shm/nccl-" in path else ""
            problems.append(f"deleted file {path[:-len(' (deleted)')]} is mapped shared by this rank and by "
                            f"{owner(theirs.shared_maps[mkey][0])}: each restore would get its own private "
                            f"copy, so they would no longer share it{hint}")
    if ours.sockets:
        problems += _unix(ours, theirs, others, inherited, sockets)
    return problems


def _sysv(ours: Holdings) -> list[str]:
    out = []
    for (_, ino), (pid, path) in ours.shared_maps.items():
        if path.startswith("/SYSV"):
            out.append(f"SysV shared memory segment (key 0x{path[5:13]}, shmid {ino}) attached by pid {pid}: "
                       "CRIU dumps SysV IPC only inside an IPC namespace, which tasks do not get")
    return out


def _unix(ours: Holdings, theirs: Holdings, others: dict[int, str], inherited: AbstractSet[str],
          sockets: dict[int, UnixSocket] | None) -> list[str]:
    if sockets is None:
        try:
            sockets = unix_sockets()
        except OSError:
            return []        # no unix_diag: criu itself will say what it cannot dump
    mine = {ino: sockets[ino] for ino in ours.sockets if ino in sockets and f"socket:[{ino}]" not in inherited}
    if not mine:
        return []
    problems = []

    def name_of(s: UnixSocket) -> str:
        return s.name or "(unbound)"

    def holder(ino: int) -> str | None:
        pid = theirs.sockets.get(ino)
        return others.get(pid) if pid is not None else None

    for s in mine.values():
        if not s.peer or s.peer in ours.sockets:
            continue
        peer = sockets.get(s.peer)
        where = holder(s.peer) or "a process outside this task"
        peer_name = name_of(peer) if peer else "?"
        if s.type != SOCK_DGRAM:
            problems.append(f"unix {_TYPE.get(s.type, str(s.type))} socket {name_of(s)} is connected to "
                            f"{peer_name} in {where}: CRIU cannot checkpoint one end of a connection")
        elif holder(s.peer):
            problems.append(f"unix datagram socket {name_of(s)} is connected to {peer_name} of {where}: its "
                            "restore must connect again, which fails until that rank is restored")
    # the other direction: sockets of other tasks connected to ours
    for ino, pid in theirs.sockets.items():
        other = sockets.get(ino)
        if other and other.peer in mine and other.type == SOCK_DGRAM:
            problems.append(f"unix datagram socket {name_of(mine[other.peer])} receives from a socket connected "
                            f"to it in {others.get(pid, f'pid {pid}')}: datagrams sent before this rank is "
                            "restored would be refused")
    # datagram sockets that address each other by path (sendto): a bound one on one side, an unconnected
    # sender on the other; nothing links them in the kernel, so this is what can be seen of it
    bound = [s for s in mine.values() if s.type == SOCK_DGRAM and s.name and not s.peer]
    free = [s for s in mine.values() if s.type == SOCK_DGRAM and not s.peer]
    senders = {others[pid] for ino, pid in theirs.sockets.items()
               if (t := sockets.get(ino)) and t.type == SOCK_DGRAM and not t.peer and bound}
    receivers = {others[pid] for ino, pid in theirs.sockets.items()
                 if (t := sockets.get(ino)) and t.type == SOCK_DGRAM and t.name and not t.peer and free}
    if senders or receivers:
        ends = (bound if senders else []) + (free if receivers else [])
        problems.append(f"unix datagram socket(s) {', '.join(sorted({name_of(s) for s in ends}))} and "
                        f"unconnected datagram sockets of {', '.join(sorted(senders | receivers))} can send to "
                        "each other by path: a datagram sent while only one of the ranks is restored is refused")
    return problems


# ---- files mapped shared by two ranks: exact or refused at restore ----------------------------------------
# A file two ranks map shared and one of them writes is not in the images: criu maps it again by path. After
# a final capture it still holds what it held at the freeze; after a crash that followed a periodic capture
# it holds what the ranks wrote since (measured: the restored ranks then skip hundreds of messages), and on
# another node it may be missing. A /dev/shm file of the job's user is saved and written back instead
# (shm_files.py: one policy for /dev/shm), so this concerns the other files. Its size and xxh3 are recorded at the capture
# (every rank is frozen then) and the first rank of the node to restore compares them; all ranks of that
# restore share its verdict (rendezvous.first_on_node), since the ranks restored earlier already write to the
# file. Root reads these files only through the tree's own mappings (/proc/PID/map_files); at the restore
# the path is the user's and is opened and read as the user, outside any node-wide lock, for a bounded time.
def shared_files(pids: list[int], peers: set[int]) -> list[str]:
    """Paths of files the tree maps shared that one of `peers` (other ranks of the job) maps too, with write
    access on at least one side. Regular files only (not device mappings such as the GPU driver's), as the
    mapping holds them (stat through /proc/PID/map_files, never the path)."""
    mine: dict[tuple[str, int], tuple[str, bool, int, str]] = {}
    for pid in pids:
        for key, path, perms, rng in _mappings(pid):
            if _linked(path):
                writable = key in mine and mine[key][1]
                mine[key] = (path, writable or "w" in perms, pid, rng)
    if not mine:
        return []
    theirs: dict[tuple[str, int], bool] = {}
    for pid in peers:
        for key, _, perms, _ in _mappings(pid):
            if key in mine:
                theirs[key] = theirs.get(key, False) or "w" in perms
    out = []
    for key, writable in theirs.items():
        path, mine_writable, pid, rng = mine[key]
        try:
            regular = stat.S_ISREG(procfs.path(pid, "map_files", rng).stat().st_mode)
        except OSError:
            regular = False
        if regular and (writable or mine_writable):
            out.append(path)
    return sorted(out)


def fingerprint_files(pids: list[int], paths: list[str]) -> list[dict[str, Any]]:
    """Size, xxh3, device and inode of `paths` as the tree maps them (read through /proc/PID/map_files: the
    very inode, whatever the path names now). Called while the tree is frozen."""
    want, out = set(paths), []
    for pid in pids:
        for _, path, _, rng in _mappings(pid):
            if path in want:
                src = procfs.path(pid, "map_files", rng)
                try:
                    st = src.stat()
                    out.append({"path": path, "size": st.st_size, "xxh3": file_checksum(src),
                                "dev": st.st_dev, "ino": st.st_ino})
                except OSError:
                    continue
                want.discard(path)
    return out


def check_shared_files(entries: list[dict[str, Any]], key: rendezvous.RestoreKey | str, creds: Credentials, same_node: bool,
                       lock_dir: Path | None = None) -> None:
    """Before a rank's restore: raise RestoreError naming the first file that no longer holds what it held
    at the capture (see above). The first rank of the restore `key` on this node decides for all. The path
    is the user's: it is opened as the job's user (`creds`), so the verdict says nothing about a file the
    user could not open; only a regular file of the user is read (no symlink at the end), and it must be
    the file the capture fingerprinted: the same inode, and on the node that made the capture
    (`same_node`) the same device (another node's mount of a shared file system numbers it otherwise)."""
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    for e in entries:
        marker = rendezvous.marker(lock_dir, key, "file", hashlib.sha1(e['path'].encode()).hexdigest()[:16])
        verdict, _ = rendezvous.first_on_node(marker, functools.partial(_compare, e, creds, same_node),
                                           asuser.time_for(e["size"]) + asuser.OPEN_TIMEOUT_S)
        if verdict != "ok":
            raise RestoreError(f"{e['path']} (mapped shared with another rank) {verdict}: the ranks would "
                               "not see what they shared at the checkpoint")


def _compare(entry: dict[str, Any], creds: Credentials, same_node: bool) -> str:
    path = entry["path"]

    def measure() -> bytes:       # in a child that is the job's user
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            facts: dict[str, object] = {"regular": stat.S_ISREG(st.st_mode), "uid": st.st_uid, "dev": st.st_dev,
                     "ino": st.st_ino, "size": st.st_size}
            if facts["regular"] and st.st_size == entry["size"]:
                h = xxhash.xxh3_64()      # read(), not mmap: a file cut short meanwhile is no SIGBUS
                while block := os.read(fd, 8 << 20):
                    h.update(block)
                facts["xxh3"] = h.hexdigest()
            return json.dumps(facts).encode()
        finally:
            os.close(fd)
    try:
        facts = json.loads(asuser.call_as_user(creds, measure, "opened as the job's user",
                                               asuser.time_for(entry["size"])))
    except PermissionDenied as e:
        return f"cannot be {e}; it exists only on the node and in the run that made it"
    if not facts["regular"] or facts["uid"] != creds.uid:
        return "is no longer a regular file of the job's user"
    if "ino" in entry and (facts["ino"] != entry["ino"] or (same_node and facts["dev"] != entry["dev"])):
        return "is not the file mapped at the checkpoint (replaced since)"
    if facts["size"] != entry["size"] or facts.get("xxh3") != entry["xxh3"]:
        return "changed since the checkpoint (written after it, e.g. before a crash)"
    return "ok"
