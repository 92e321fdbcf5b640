"""Files in the node's /dev/shm that the tree holds: saved with the images and put back before a restore.

POSIX named semaphores and shared memory (sem_open, shm_open) live in /dev/shm, a tmpfs of the node: Python
multiprocessing's locks and queues with spawn or forkserver workers (forkserver is Python 3.14's default),
PyTorch DataLoader workers started that way, shm_open segments. criu records such a file by its name only,
so after a requeue onto another node or a reboot it is missing, and after a crash that followed a periodic
capture it holds what the tree wrote since, not what it held at the cut. So:

- capture (tree frozen): every /dev/shm file of the job's user that the tree holds open or mapped, with a
  name, is read as the user through that name (inode checked) into the rank's images (`shm-N.data`);
- glibc's sem_open maps a semaphore by a temporary name it removes once the real name is linked. criu dumps
  a file held by a removed name that has another name only with --link-remap: it links the file to
  /dev/shm/link_remap.N for the dump (and removes that link again when the tree runs on), and the restore
  opens it by that name. The names criu used are read from the images after the dump (criu_images.py);
- restore: as the user, each file is written back under its name (created if missing, only ever a regular
  file of the user), and the link_remap names are linked to it; criu removes those once it opened them.
  Ranks of one node that share a segment (ipc_pair.py's ring) each saved it at the cut; it is written back
  once per restore of the node, by the first rank: the others find the ranks restored before them already
  writing to it.

Files of other users are left to criu (by name, as without slurmckpt); files with no name left (nlink 0) are
criu's ghost files (ghost.py). The copy is made while the tree is frozen, so a big segment lengthens the
stall (at the speed of a memory copy); it is restored exactly, so it is not refused.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from slurmckpt import asuser, criu_images, netlock, procfs
from slurmckpt.launch import Credentials

SHM_DIR = "/dev/shm"
DELETED = " (deleted)"


@dataclass
class ShmFile:
    name: str                          # a name it has now (written back under it at the restore)
    size: int
    mode: int
    dev: int
    ino: int
    removed: set[str] = field(default_factory=set)   # names the tree holds it by that no longer exist


def held(pids: list[int], uid: int, shm_dir: str = SHM_DIR) -> list[ShmFile]:
    """The user's regular files in `shm_dir` that `pids` hold open or mapped and that still have a name,
    once per inode, biggest first. Read through /proc links (stat only, never a path as root)."""
    found: dict[tuple[int, int], ShmFile] = {}
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
                if not stat.S_ISREG(st.st_mode) or st.st_nlink == 0 or st.st_uid != uid:
                    continue
                key = (st.st_dev, st.st_ino)
                f = found.get(key)
                if f is None:
                    f = found[key] = ShmFile("", st.st_size, stat.S_IMODE(st.st_mode), *key)
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


def needs_link_remap(files: list[ShmFile]) -> bool:
    return any(f.removed for f in files)


def save(creds: Credentials, files: list[ShmFile], images: Path) -> list[dict]:
    """Copy each file's content (read as the user, through its name, refused unless it is the very inode
    the tree holds) into `images`. Returns the rank record's entries."""
    out = []
    for i, f in enumerate(files):
        src = asuser.open_expected(creds, f.name, os.O_RDONLY, f.dev, f.ino, f"a file in {SHM_DIR} the job holds,")
        data = f"shm-{i}.data"
        try:
            size = _copy(src, images / data)
        finally:
            os.close(src)
        out.append({"name": f.name, "size": size, "mode": f.mode, "data": data,
                    "removed": sorted(f.removed), "links": []})
    return out


def note_remaps(entries: list[dict], images: Path) -> None:
    """After the dump: the link_remap names criu gave files held by a removed name (restored by those)."""
    for removed, remap in criu_images.linked_remaps(images):
        for e in entries:
            if removed in e["removed"] and remap not in e["links"]:
                e["links"].append(remap)


def put_back(creds: Credentials, entries: list[dict], images: Path, key: str | None = None,
             lock_dir: Path | None = None) -> None:
    """Before criu restores: as the user, each file written back under its name and linked under the names
    criu will open. Only a regular file of the user is written (created if missing, never through a
    symlink); PermissionDenied names the file otherwise. With `key` (netlock.restore_key: this restore of
    the job on this node) a file is written back once per restore: ranks of one node that share a segment
    each saved the same bytes at the cut, and the ranks restored first already write to it again (a second
    write-back would put old slots under their new counters)."""
    lock_dir = lock_dir or netlock.LOCK_DIR
    for e in entries:
        marker = lock_dir / f"{key}.shm.{hashlib.sha1(e['name'].encode()).hexdigest()[:16]}" if key else None
        with open(images / e["data"], "rb") as src, (netlock.node_lock(lock_dir) if marker else nullcontext()):
            content = marker is None or not marker.exists()

            def write_back(e: dict = e, src_fd: int = src.fileno(), content: bool = content) -> None:
                fd = os.open(e["name"], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, e["mode"])
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                        raise OSError(errno.EPERM, "not a regular file of the job's user", e["name"])
                    if content:
                        os.ftruncate(fd, 0)
                        while block := os.read(src_fd, 1 << 20):
                            view = memoryview(block)
                            while view:
                                view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                for link in e["links"]:
                    try:
                        os.unlink(link)
                    except FileNotFoundError:
                        pass
                    os.link(e["name"], link)
            asuser.run_as_user(creds, write_back, f"cannot put back {e['name']} for the restore")
            if marker is not None and content:
                marker.write_text("put back\n")


def remove_links(creds: Credentials, entries: list[dict]) -> None:
    """The link_remap names left in /dev/shm (criu removes them after a restore; a final dump may leave
    them): removed as the user."""
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


def _copy(src: int, dst: Path) -> int:
    size = 0
    with os.fdopen(os.dup(src), "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(8 << 20):
            fout.write(block)
            size += len(block)
    return size
