"""Files in /dev/shm a tree holds (shm_files.py) and the criu image records read for them (criu/images.py)."""
from __future__ import annotations

import mmap
import os
import stat
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

from slurmckpt.rank.sharing import shm_files
from slurmckpt.criu import images as criu_images


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _image(path, entries: list[bytes]) -> None:
    path.write_bytes(struct.pack("<II", 0x54564319, 0x12345678)
                     + b"".join(struct.pack("<I", len(e)) + e for e in entries))


def _reg(file_id: int, name: str) -> bytes:
    reg = _field(1, file_id) + _field(2, 2) + _field(3, 0) + _field(6, name.encode()) + _field(10, 0o100600)
    return _field(1, 1) + _field(2, file_id) + _field(3, reg)


def test_linked_remaps_pairs_the_removed_name_with_criu_s_temporary_link(tmp_path) -> None:
    """remap-fpath.img's linked records are resolved through files.img to (removed name, link_remap name);
    ghost records and ids without a file record are left out."""
    _image(tmp_path / "files.img", [_reg(7, "/dev/shm/sem.Ab12"), _reg(9, "/dev/shm/link_remap.9"),
                                    _reg(11, "/home/u/out.txt")])
    _image(tmp_path / "remap-fpath.img", [_field(1, 7) + _field(2, 9) + _field(3, 0),
                                          _field(1, 11) + _field(2, 40) + _field(3, 1),
                                          _field(1, 5) + _field(2, 9) + _field(3, 0)])
    assert criu_images.linked_remaps(tmp_path) == [("/dev/shm/sem.Ab12", "/dev/shm/link_remap.9")]


def test_no_remap_image_means_no_remaps(tmp_path) -> None:
    """A dump without --link-remap writes no remap-fpath.img: nothing to put back."""
    assert criu_images.linked_remaps(tmp_path) == []


def _mapped(path) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED)


def test_held_names_each_inode_once_and_finds_the_name_left_for_a_removed_one(tmp_path) -> None:
    """A file mapped by its name is listed by it; one mapped by a name since removed (sem_open's temporary
    name) is listed by the name that remains, with the removed one; a file with no name left (a ghost file,
    criu's own) is not listed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "seg").write_bytes(b"x" * 4096)
    (shm / "sem.tmp").write_bytes(b"s" * 4096)
    (shm / "ghost").write_bytes(b"g" * 4096)
    maps = [_mapped(shm / "seg"), _mapped(shm / "sem.tmp"), _mapped(shm / "ghost")]
    try:
        os.link(shm / "sem.tmp", shm / "sem.mp-real")
        os.unlink(shm / "sem.tmp")
        os.unlink(shm / "ghost")
        found = shm_files.held([os.getpid()], os.getuid(), str(shm))
        by_name = {f.name: f for f in found}
        assert set(by_name) == {str(shm / "seg"), str(shm / "sem.mp-real")}
        assert by_name[str(shm / "sem.mp-real")].removed == {str(shm / "sem.tmp")}
        assert by_name[str(shm / "seg")].removed == set()
        assert shm_files.needs_link_remap(found)
        assert shm_files.held([os.getpid()], os.getuid() + 1, str(shm)) == []
    finally:
        for m in maps:
            m.close()


def test_note_remaps_attaches_each_link_to_the_file_held_by_the_removed_name(tmp_path) -> None:
    """After the dump each link_remap name criu used is recorded with the file whose removed name it
    stands for, so the restore can link it again."""
    _image(tmp_path / "files.img", [_reg(3, "/dev/shm/sem.Xy"), _reg(4, "/dev/shm/link_remap.4")])
    _image(tmp_path / "remap-fpath.img", [_field(1, 3) + _field(2, 4) + _field(3, 0)])
    entries = [{"name": "/dev/shm/sem.mp-a", "removed": ["/dev/shm/sem.Xy"], "links": []},
               {"name": "/dev/shm/other", "removed": [], "links": []}]
    shm_files.note_remaps(entries, tmp_path)
    assert [e["links"] for e in entries] == [["/dev/shm/link_remap.4"], []]


@pytest.mark.system
def test_put_back_writes_as_the_user_and_never_through_a_symlink() -> None:
    """Root puts files back for a user: a name the user points at a root file (symlink) is refused and the
    target is untouched; a missing name is created owned by the user with the saved content and, for the
    removed names the tree held it by, handed to criu as an fd, with no name made for it: another user's
    file at criu's old link_remap name changes nothing."""
    if os.getuid() != 0:
        pytest.fail("this test drops to another user's credentials: run it as root (as CI does)")
    from slurmckpt.errors import PermissionDenied
    from slurmckpt.node.launch import Credentials
    nobody = Credentials(65534, 65534, (), ())
    tmp_path = Path(tempfile.mkdtemp(prefix="shm-files-"))      # pytest's tmp_path is root's alone (0700)
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    tmp_path.chmod(0o755)
    images = tmp_path / "images"
    images.mkdir()
    (images / "shm-0.data").write_bytes(b"saved")
    secret = tmp_path / "root-owned"
    secret.write_text("root's")
    (shm / "sem.evil").symlink_to(secret)
    with pytest.raises(PermissionDenied, match="sem.evil"):
        shm_files.put_back(nobody, [{"name": str(shm / "sem.evil"), "size": 5, "mode": 0o600, "data": "shm-0.data",
                                     "links": []}], images)
    assert secret.read_text() == "root's"
    squatted = shm / "link_remap.3"
    squatted.write_text("another user's")
    os.chown(squatted, 65533, 65533)
    entry = {"name": str(shm / "sem.mp-a"), "size": 5, "mode": 0o600, "data": "shm-0.data",
             "removed": [str(shm / "sem.Xy12ab")], "links": [str(squatted)]}
    handed = shm_files.put_back(nobody, [entry], images)
    try:
        st = os.stat(shm / "sem.mp-a")
        assert (st.st_uid, (shm / "sem.mp-a").read_bytes()) == (65534, b"saved")
        assert [key for key, _ in handed.inherit] == [str(shm / "sem.Xy12ab").lstrip("/")]
        fd = handed.inherit[0][1]
        assert (os.fstat(fd).st_ino, os.get_blocking(fd) is False) == (st.st_ino, True)
        assert os.read(fd, 5) == b"saved" and os.pwrite(fd, b"S", 0) == 1      # read-write, as criu maps it
        assert squatted.read_text() == "another user's" and not (shm / "sem.Xy12ab").exists()
    finally:
        handed.close()
    shutil.rmtree(tmp_path)


@pytest.mark.system
def test_a_name_another_user_took_is_worked_around_with_a_file_of_the_users_without_a_name(monkeypatch) -> None:
    """While the job was away another user made a file at its semaphore's name: the restore leaves that file
    alone and hands criu a new file of the job's user, without a name, holding the saved bytes, for the name
    and the removed names; for a file other ranks map too it refuses, naming the other user."""
    if os.getuid() != 0:
        pytest.fail("this test drops to another user's credentials: run it as root (as CI does)")
    from slurmckpt.errors import PermissionDenied
    from slurmckpt.node.launch import Credentials
    nobody = Credentials(65534, 65534, (), ())
    tmp_path = Path(tempfile.mkdtemp(prefix="shm-taken-"))
    try:
        shm, images = tmp_path / "shm", tmp_path / "images"
        shm.mkdir()
        images.mkdir()
        shm.chmod(0o1777)
        tmp_path.chmod(0o755)
        monkeypatch.setattr(shm_files, "SHM_DIR", str(shm))
        (images / "shm-0.data").write_bytes(b"at the cut")
        taken = shm / "sem.mp-a"
        taken.write_text("a stranger's")
        os.chown(taken, 65533, 65533)
        entry = {"name": str(taken), "size": 10, "mode": 0o640, "data": "shm-0.data",
                 "removed": [str(shm / "sem.tmpAb")], "links": []}
        handed = shm_files.put_back(nobody, [entry], images)
        try:
            assert sorted(k for k, _ in handed.inherit) == sorted([str(taken).lstrip("/"),
                                                                   str(shm / "sem.tmpAb").lstrip("/")])
            fd = handed.inherit[0][1]
            st = os.fstat(fd)
            assert (st.st_uid, st.st_nlink, stat.S_IMODE(st.st_mode)) == (65534, 0, 0o640)
            assert os.pread(fd, 64, 0) == b"at the cut"
            assert taken.read_text() == "a stranger's" and taken.stat().st_uid == 65533
        finally:
            handed.close()
        with pytest.raises(PermissionDenied, match="uid 65533"):
            shm_files.put_back(nobody, [entry], images, shared={str(taken)})
    finally:
        shutil.rmtree(tmp_path)


@pytest.mark.system
def test_a_segment_two_ranks_share_is_written_back_once_per_restore() -> None:
    """Two ranks of one node saved the same segment: the first rank's restore writes it back; the second,
    coming after the first rank runs again and wrote to it, leaves the content alone (a second write-back
    would put old slots under new counters) but still hands the file in for its own removed name."""
    if os.getuid() != 0:
        pytest.fail("this test drops to another user's credentials: run it as root (as CI does)")
    from slurmckpt.node.launch import Credentials
    nobody = Credentials(65534, 65534, (), ())
    tmp_path = Path(tempfile.mkdtemp(prefix="shm-once-"))
    try:
        shm, images, locks = tmp_path / "shm", tmp_path / "images", tmp_path / "locks"
        for d in (shm, images, locks):
            d.mkdir()
        shm.chmod(0o1777)
        tmp_path.chmod(0o755)
        (images / "shm-0.data").write_bytes(b"at the cut")
        seg = shm / "ring"
        first = {"name": str(seg), "size": 10, "mode": 0o600, "data": "shm-0.data", "links": []}
        shm_files.put_back(nobody, [first], images, key="7.1.3.99", lock_dir=locks)
        assert seg.read_bytes() == b"at the cut"
        os.chown(seg, 65534, 65534)
        seg.write_bytes(b"rank 1 ran on")                     # the first rank, restored, writes again
        second = {**first, "removed": [str(shm / "sem.tmp5")]}
        handed = shm_files.put_back(nobody, [second], images, key="7.1.3.99", lock_dir=locks)
        assert seg.read_bytes() == b"rank 1 ran on"
        assert os.fstat(handed.inherit[0][1]).st_ino == seg.stat().st_ino
        handed.close()
        shm_files.put_back(nobody, [first], images, key="7.2.3.99", lock_dir=locks)     # another restart
        assert seg.read_bytes() == b"at the cut"
    finally:
        shutil.rmtree(tmp_path)


def _node_lock_free_within(lock_dir: Path, seconds: float) -> bool:
    """Whether the restore lock another job takes (rendezvous.job_lock; the node-wide `.lock` of the old
    write-back) can be taken within `seconds` (polled: a test of the old write-back must fail, not hang
    behind it)."""
    import fcntl
    import time
    deadline = time.monotonic() + seconds
    with open(lock_dir / ".lock", "a") as f, open(lock_dir / ".lock-8", "a") as g:
        while True:
            try:
                for lock in (f, g):
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(lock, fcntl.LOCK_UN)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


@pytest.mark.system
def test_a_fifo_at_the_name_fails_the_write_back_at_once_and_holds_no_node_lock() -> None:
    """The job's user puts a FIFO at its own /dev/shm name between the capture and the restore: the
    write-back used to open it for writing inside the node-wide restore lock and wait there for a reader,
    for as long as the user liked, and every other user's restore on the node waited with it. Now the
    open does not wait (O_NONBLOCK, a non-regular file refused) and no node-wide lock is held around it."""
    if os.getuid() != 0:
        pytest.fail("this test drops to another user's credentials: run it as root (as CI does)")
    import threading
    import time
    from slurmckpt.errors import PermissionDenied
    from slurmckpt.node.launch import Credentials
    nobody = Credentials(65534, 65534, (), ())
    tmp_path = Path(tempfile.mkdtemp(prefix="shm-fifo-"))
    try:
        shm, images, locks = tmp_path / "shm", tmp_path / "images", tmp_path / "locks"
        for d in (shm, images, locks):
            d.mkdir()
        shm.chmod(0o1777)
        tmp_path.chmod(0o755)
        (images / "shm-0.data").write_bytes(b"at the cut")
        os.mkfifo(shm / "ring", 0o600)
        os.chown(shm / "ring", 65534, 65534)
        entry = {"name": str(shm / "ring"), "size": 10, "mode": 0o600, "data": "shm-0.data", "links": []}
        outcome: list[BaseException | None] = []

        def restore() -> None:
            try:
                shm_files.put_back(nobody, [entry], images, key="7.1.3.99", lock_dir=locks)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)
        attacker = threading.Thread(target=restore, daemon=True)
        attacker.start()
        time.sleep(0.5)
        assert _node_lock_free_within(locks, 3), "another user's restore waits for the node-wide lock"
        attacker.join(10)
        assert not attacker.is_alive(), "the write-back is waiting on the user's FIFO"
        assert isinstance(outcome[0], PermissionDenied) and "not a regular file" in str(outcome[0]), outcome
        with pytest.raises(PermissionDenied, match="not a regular file"):       # the other ranks: its verdict
            shm_files.put_back(nobody, [entry], images, key="7.1.3.99", lock_dir=locks)
    finally:
        os.close(os.open(shm / "ring", os.O_RDONLY | os.O_NONBLOCK))    # a reader: frees a writer left waiting
        shutil.rmtree(tmp_path)


@pytest.mark.system
def test_a_held_segment_is_saved_by_its_data_and_put_back_with_its_holes(tmp_path) -> None:
    """A segment sized with ftruncate and barely touched (shm_open's way): its copy takes the bytes it
    holds, not its size, and charges them; the write-back gives the same size, content and holes."""
    seg = Path("/dev/shm") / f"slurmckpt-test-sparse-{os.getpid()}"
    try:
        with open(seg, "wb") as f:
            f.write(b"slot 0")
            f.truncate(1 << 30)
        fd = os.open(seg, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            files = shm_files.held([os.getpid()], os.getuid())
            mine = [f for f in files if f.name == str(seg)]
            assert mine and mine[0].allocated == st.st_blocks * 512 < 1 << 20
            from slurmckpt.node.launch import Credentials
            me = Credentials(os.getuid(), os.getgid(), tuple(os.getgroups()), ())
            charged: list[tuple[int, str, int]] = []
            entries = shm_files.save(me, mine, tmp_path, lambda n, name, size: charged.append((n, name, size)))
        finally:
            os.close(fd)
        assert (tmp_path / "shm-0.data").stat().st_size == sum(n for n, _, _ in charged) < 1 << 20
        assert {(name, size) for _, name, size in charged} == {(str(seg), 1 << 30)}
        seg.unlink()
        shm_files.put_back(me, entries, tmp_path)
        st = seg.stat()
        assert (st.st_size, seg.open("rb").read(6)) == (1 << 30, b"slot 0")
        assert st.st_blocks * 512 < 1 << 20, "the holes were written"
    finally:
        seg.unlink(missing_ok=True)


@pytest.mark.system
def test_a_file_system_mounted_below_dev_shm_is_not_ours_to_copy(tmp_path) -> None:
    """A user can mount a file system of its own (FUSE) on a directory in /dev/shm; a file there, held by
    the tree, could make root's copy block for as long as the user likes: only /dev/shm's own files are
    taken (criu handles the rest by name)."""
    from smallfs import tmpfs
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "seg").write_bytes(b"x" * 4096)
    with tmpfs(shm / "mounted", 1 << 20) as sub:
        (sub / "seg").write_bytes(b"y" * 4096)
        maps = [_mapped(shm / "seg"), _mapped(sub / "seg")]
        try:
            assert [f.name for f in shm_files.held([os.getpid()], os.getuid(), str(shm))] == [str(shm / "seg")]
        finally:
            for m in maps:
                m.close()
