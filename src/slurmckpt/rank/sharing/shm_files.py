"""Files in the node's /dev/shm that the tree holds: saved with the images and put back before a restore.

POSIX named semaphores and shared memory (sem_open, shm_open) live in /dev/shm, a tmpfs of the node: Python
multiprocessing's locks and queues with spawn or forkserver workers (forkserver is Python 3.14's default),
PyTorch DataLoader workers started that way, shm_open segments. criu records such a file by its name only,
so after a requeue onto another node or a reboot it is missing, and after a crash that followed a periodic
capture it holds what the tree wrote since, not what it held at the cut. So:

- capture (tree frozen): every /dev/shm file of the job's user that the tree holds open or mapped, with a
  name, is read as the user through that name (inode checked) into the rank's images (`shm-N.data`): its
  data ranges only (sparse.py: a segment sized with ftruncate and never touched costs nothing), charged to
  the capture's budget of copied bytes (space.CopyBudget), which PREPARE counted and reserved;
- glibc's sem_open maps a semaphore by a temporary name it removes once the real name is linked. criu dumps
  a file held by a removed name that has another name only with --link-remap: it links the file to a
  `link_remap.<random>` name in /dev/shm for the dump, as the task (our criu patch 0007), and removes that
  link again when the tree runs on; after a final dump slurmckpt removes it, as the user. The names criu
  used are read from the images after the dump (criu/images.py);
- restore: as the user, each file is written back under its name (created if missing, only ever a regular
  file of the user: opened O_NONBLOCK|O_NOFOLLOW, so a FIFO, a lease or a symlink put at the name is
  refused at once). A file held by removed names is then opened as the user and handed to criu for each of
  those names (--inherit-fd; patch 0007 then leaves its link remap alone): no name in /dev/shm is made for
  the restore, so nothing another user puts there (a squatted link_remap name) can fail it.
  Ranks of one node that share a segment (ipc_pair.py's ring) each saved it at the cut; it is written back
  once per restore of the node, by the first rank (rendezvous.first_on_node: no node-wide lock is held while
  the user's path is written, and the write is killed past its time limit), the others wait for its
  verdict: the ranks restored before them already write to it.

Files of other users are left to criu (by name, as without slurmckpt); files with no name left (nlink 0) are
criu's ghost files (ghost.py). The copy is made while the tree is frozen, so a big segment lengthens the
stall (at the speed of a memory copy); it is restored exactly, so it is not refused unless it is over the
capture's bounds (space.py).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Callable

from slurmckpt.rank.sharing import rendezvous
from slurmckpt.node import procfs
from slurmckpt.store import sparse
from slurmckpt.node import asuser
from slurmckpt.criu import images as criu_images
from slurmckpt.errors import PermissionDenied
from slurmckpt.node.launch import Credentials

SHM_DIR = "/dev/shm"
log = logging.getLogger("slurmckpt.shm")
DELETED = " (deleted)"


@dataclass
class ShmFile:
    name: str                          # a name it has now (written back under it at the restore)
    size: int
    allocated: int                     # bytes it holds (sparse.allocated): what its copy takes
    mode: int
    dev: int
    ino: int
    removed: set[str] = field(default_factory=set)   # names the tree holds it by that no longer exist


def held(pids: list[int], uid: int, shm_dir: str = SHM_DIR) -> list[ShmFile]:
    """The user's regular files in `shm_dir` that `pids` hold open or mapped and that still have a name,
    once per inode, biggest first. Read through /proc links (stat only, never a path as root). Only files of
    `shm_dir`'s own file system: one the user mounted below it (a FUSE directory) could block root's copy."""
    found: dict[tuple[int, int], ShmFile] = {}
    shm_dev = os.stat(shm_dir).st_dev
    for pid in pids:
        for folder, names in (("fd", procfs.fds(pid)), ("map_files", procfs.map_files(pid))):
            for name in names:
                link_path = procfs.path(pid, folder, name)
                try:
                    link = os.readlink(link_path)
                    if not link.startswith(shm_dir + "/"):
                        continue
                    st = os.stat(link_path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_nlink == 0 or st.st_uid != uid or st.st_dev != shm_dev:
                    continue
                key = (st.st_dev, st.st_ino)
                f = found.get(key)
                if f is None:
                    f = found[key] = ShmFile("", st.st_size, sparse.allocated(st), stat.S_IMODE(st.st_mode), *key)
                if link.endswith(DELETED):
                    f.removed.add(link[:-len(DELETED)])
                elif not f.name:
                    f.name = link
    missing = {key: f for key, f in found.items() if not f.name}
    if missing:         # held only by removed names: find the name that remains (sem_open's real name)
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                f = missing.get((st.st_dev, st.st_ino))
                if f is not None and not f.name:
                    f.name = entry.path
    return sorted((f for f in found.values() if f.name), key=lambda f: (-f.size, f.name))


def shm_dev(shm_dir: str = SHM_DIR) -> int:
    """The device of the node's /dev/shm: files held by removed names there are saved by this module."""
    return os.stat(shm_dir).st_dev


def needs_link_remap(files: list[ShmFile]) -> bool:
    return any(f.removed for f in files)


def save(creds: Credentials, files: list[ShmFile], images: Path,
         charge: Callable[[int, str, int], None]) -> list[dict[str, Any]]:
    """Copy each file's data (read as the user, through its name, refused unless it is the very inode the
    tree holds) into `images`, holes left out; `charge(bytes, name, size)` before each range (it raises to
    refuse the capture). Returns the rank record's entries."""
    out = []
    for i, f in enumerate(files):
        src = asuser.open_expected(creds, f.name, os.O_RDONLY, f.dev, f.ino, f"a file in {SHM_DIR} the job holds,")
        data = f"shm-{i}.data"
        try:
            size = os.fstat(src).st_size
            ranges = sparse.copy_data(src, images / data, size, lambda n: charge(n, f.name, size), f.name)
        finally:
            os.close(src)
        out.append({"name": f.name, "size": size, "ranges": ranges, "mode": f.mode, "data": data,
                    "removed": sorted(f.removed), "links": []})
    return out


def note_remaps(entries: list[dict[str, Any]], images: Path) -> None:
    """After the dump: the link_remap names criu gave files held by a removed name (restored by those)."""
    for removed, remap in criu_images.linked_remaps(images):
        for e in entries:
            if removed in e["removed"] and remap not in e["links"]:
                e["links"].append(remap)


@dataclass
class HandedIn:
    """What put_back opened for criu: the fds (the caller closes them) and criu's keys for them."""
    fds: list[int] = field(default_factory=list)
    inherit: list[tuple[str, int]] = field(default_factory=list)     # (criu's key: a path without its '/', fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.inherit.clear()


def put_back(creds: Credentials, entries: list[dict[str, Any]], images: Path, key: rendezvous.RestoreKey | str | None = None,
             lock_dir: Path | None = None, shared: AbstractSet[str] = frozenset()) -> HandedIn:
    """Before criu restores: as the user, each file written back under its name (a regular file of the
    user, created if missing, never through a symlink, never a FIFO); PermissionDenied names the file
    otherwise, or when the write took longer than its time limit. With `key` (rendezvous.restore_key: this
    restore of the job on this node) a file's content is written back once per restore: ranks of one node
    that share a segment each saved the same bytes at the cut, and the ranks restored first already write
    to it again (a second write-back would put old slots under their new counters); the others wait for
    the first one's verdict (at most as long as its write may take). A file the tree held by removed names
    is then opened as the user and returned for criu to take in their place (--inherit-fd).
    A name another user's file holds now (made there while the job was away) is worked around: the saved
    content goes into a new file without a name, made by the user, handed to criu for that name too; the
    name stays the other user's. Not for a file another rank of the job maps too (`shared`: their restores
    would each get a file of their own): that is refused, naming the other user."""
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    handed = HandedIn()
    try:
        for e in entries:
            what = f"cannot put back {e['name']} for the restore"
            stranger = _stranger_at(e["name"], creds.uid)
            if stranger is not None:
                if e["name"] in shared:
                    raise PermissionDenied(f"{what}: the name is a file of uid {stranger} now, and other ranks "
                                           "of the job map it too", uid=creds.uid)
                _hand_in_unnamed(creds, e, images, handed, what, stranger)
                continue
            with open(images / e["data"], "rb") as src:
                def write(content: bool, e: dict[str, Any] = e, src_fd: int = src.fileno()) -> str:
                    asuser.run_as_user(creds, lambda: _write_back(e, src_fd, content), what,
                                       asuser.time_for(e["size"] if content else 0))
                    return "ok"
                if key is None:
                    write(True)
                else:
                    marker = rendezvous.marker(lock_dir, key, "shm", hashlib.sha1(e['name'].encode()).hexdigest()[:16])
                    verdict, wrote = rendezvous.first_on_node(marker, lambda: write(True),
                                                           asuser.time_for(e["size"]) + asuser.OPEN_TIMEOUT_S)
                    if verdict != "ok":
                        raise PermissionDenied(f"{what}: {verdict}", uid=creds.uid)
                    if not wrote:
                        write(False)
            if e.get("removed"):
                _hand_in(creds, e, handed, what)
    except BaseException:
        handed.close()
        raise
    return handed


def _stranger_at(name: str, uid: int) -> int | None:
    """The owner of what holds `name` (a direct entry of /dev/shm, root's sticky directory: nothing on the
    way to follow) when that is another user than `uid`; None when it is missing or the user's own."""
    if os.path.dirname(name) != SHM_DIR:
        return None
    try:
        owner = os.lstat(name).st_uid
    except FileNotFoundError:
        return None
    return owner if owner != uid else None


def _hand_in_unnamed(creds: Credentials, e: dict[str, Any], images: Path, handed: HandedIn, what: str,
                     stranger: int) -> None:
    """The saved content in a new file of the user in /dev/shm without a name (O_TMPFILE, opened as the
    user), handed to criu for the name and every removed name the tree held it by."""
    log.warning("%s under its name: another user's file (uid %d) holds the name now; the job's file is "
                "restored without a name", what.replace("cannot put back", "not putting back"), stranger)
    fd = asuser.open_as_user(creds, SHM_DIR, os.O_TMPFILE | os.O_RDWR)
    handed.fds.append(fd)
    with open(images / e["data"], "rb") as src:
        sparse.write_back(fd, src.fileno(), e.get("ranges"), e["size"])
    os.fchmod(fd, e["mode"])
    handed.inherit += [(n.lstrip("/"), fd) for n in [e["name"], *e.get("removed", [])]]


def _hand_in(creds: Credentials, e: dict[str, Any], handed: HandedIn, what: str) -> None:
    """The file just written back, opened read-write as the user for every removed name the tree held it
    by: criu maps or installs it there as the tree had it (one open file description per file)."""
    fd = asuser.open_as_user(creds, e["name"], os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    handed.fds.append(fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != creds.uid:
        raise PermissionDenied(f"{what}: not a regular file of the job's user any more", uid=creds.uid)
    handed.inherit += [(removed.lstrip("/"), fd) for removed in e["removed"]]


def _write_back(e: dict[str, Any], src_fd: int, content: bool) -> None:
    """In the child that is the job's user: the file at e["name"] (a regular file of the user, created if
    missing) given the saved content."""
    try:
        st = os.lstat(e["name"])
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EPERM, "not a regular file of the job's user (a FIFO, link or device put "
                          "there since the checkpoint)", e["name"])
    except FileNotFoundError:
        pass
    # O_NONBLOCK: whatever replaced the file between the lstat and here answers at once (a FIFO without a
    # reader: ENXIO; a lease: EWOULDBLOCK), and the fstat below refuses it
    fd = os.open(e["name"], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, e["mode"])
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(errno.EPERM, "not a regular file of the job's user", e["name"])
        if content:
            sparse.write_back(fd, src_fd, e.get("ranges"), e["size"])
    finally:
        os.close(fd)


def remove_links(creds: Credentials, entries: list[dict[str, Any]]) -> None:
    """The link_remap names a final dump left in /dev/shm (criu removes them itself after a periodic one):
    removed as the user. The restore needs none of them (put_back hands the files in)."""
    links = [link for e in entries for link in e["links"]]
    if not links:
        return

    def unlink_all() -> None:
        for link in links:
            try:
                os.unlink(link)
            except FileNotFoundError:
                pass
    asuser.run_as_user(creds, unlink_all, "cannot remove criu's temporary links in /dev/shm")

