"""Persist and restore of a rank's images: compression where it saves space, checksums over the stored bytes
checked while unpacking, the persisting thread's priority, and the rank's staging life cycle."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from slurmckpt.rank import images as rank_images
from slurmckpt.store import compression
from slurmckpt.store import persist
from slurmckpt.store.compression import PLAIN, Zstd
from slurmckpt.errors import ConfigError, RestoreError, SlurmckptError, StorageError
from slurmckpt.store.persist import Priority, bounded, materialize, persist_rank
from dataclasses import replace
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from slurmckpt.store.record import Capture
from store_harness import Tree, capture, images, rank_runner, read_back, settled


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "images", "c", 5)
    s.ensure()
    return s


def staged(tmp_path: Path, files: dict[str, bytes]) -> Path:
    d = tmp_path / "staged"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def test_compressible_files_are_compressed_and_random_ones_stored_raw(store, tmp_path):
    files = images(3, kib=512)
    m = persist_rank(store, 1, "0", 0, staged(tmp_path, files), Capture(), Zstd(1, 2))
    entries = m.seal.files
    assert entries["pages-2.img"]["codec"] == "zstd" and entries["pages-2.img"]["stored"] == "pages-2.img.zst"
    assert entries["pages-2.img"]["size"] * 5 < entries["pages-2.img"]["raw_size"] == len(files["pages-2.img"])
    assert entries["pages-1.img"]["codec"] == "none" and entries["pages-1.img"]["size"] == 512 << 10
    rdir = store.rank_dir(1, "0", 0)
    assert sorted(p.name for p in rdir.iterdir()) == sorted(e["stored"] for e in entries.values()) + ["rank.json"]
    assert read_back(store, 1, tmp_path / "back", step="0") == files
    store.verify_rank(1, "0", 0, full=True)          # the checksums are over what is stored


def test_off_stores_every_file_raw(store, tmp_path):
    files = images(4)
    m = persist_rank(store, 1, "0", 0, staged(tmp_path, files), Capture(), compression.from_settings("off", 1, 1))
    assert {e["codec"] for e in m.seal.files.values()} == {"none"}
    assert read_back(store, 1, tmp_path / "back", step="0") == files


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_a_damaged_compressed_file_is_refused_while_unpacking(store, tmp_path, damage):
    persist_rank(store, 1, "0", 0, staged(tmp_path, images(5)), Capture(), Zstd(1, 1))
    path = store.rank_dir(1, "0", 0) / "pages-2.img.zst"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-7]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    (tmp_path / "back").mkdir()
    with pytest.raises(StorageError, match="pages-2.img corrupt"):
        materialize(store, 1, "0", 0, tmp_path / "back")


def test_unpacking_refuses_bad_names_and_codecs_from_rank_json(store, tmp_path):
    persist_rank(store, 1, "0", 0, staged(tmp_path, {"a.img": b"a" * 100}), Capture(), Zstd(1, 1))
    rank_json = store.rank_dir(1, "0", 0) / "rank.json"
    m = json.loads(rank_json.read_text())
    for files, message in [({"../x": m["files"]["a.img"]}, "bad file"),
                           ({"a.img": {**m["files"]["a.img"], "stored": "../../manifest.json"}}, "bad file"),
                           ({"a.img": {**m["files"]["a.img"], "codec": "lz4"}}, "unknown codec")]:
        rank_json.write_text(json.dumps({**m, "files": files}))
        back = tmp_path / f"back{len(message)}{len(str(files))}"
        back.mkdir()
        with pytest.raises(StorageError, match=message):
            materialize(store, 1, "0", 0, back)


def test_a_failed_persist_leaves_no_rank_directory(store, tmp_path, monkeypatch):
    """EIO in the middle of the stored bytes: StorageError names the file; nothing of the rank stays."""
    real = persist.Sink.write
    calls = [0]

    def failing(self, data):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(5, "Input/output error")
        return real(self, data)
    monkeypatch.setattr(persist.Sink, "write", failing)
    with pytest.raises(StorageError, match=r"persisting \S+ to the store failed: Input/output error"):
        persist_rank(store, 1, "0", 0, staged(tmp_path, images(6)), Capture(), Zstd(1, 1))
    store.empty_trash()
    assert not store.rank_dir(1, "0", 0).exists()


def _task_nice_and_ioprio() -> list[tuple[int, int, int]]:
    """(tid, nice, ioprio) of every thread of this process that runs at a lowered nice."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue                  # the thread ended meanwhile
        ioprio = libc.syscall(252, 1, int(tid))              # ioprio_get (x86_64); -1: the thread ended
        if nice and ioprio != -1:
            out.append((int(tid), nice, ioprio))
    return out


def test_a_background_persist_runs_at_lowered_nice_and_io_priority_including_zstd_workers():
    seen: list = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.extend(_task_nice_and_ioprio())

    watcher = threading.Thread(target=watch)
    watcher.start()
    data = os.urandom(4 << 20) * 8

    def work():
        import io
        sink = compression.Sink(os.open(os.devnull, os.O_WRONLY))
        Zstd(1, 2).encode(io.BytesIO(data), sink, len(data))
        os.close(sink.fd)
        return threading.get_native_id()
    try:
        tid = bounded(Priority(nice=7, io_class="idle"), work)
    finally:
        stop.set()
        watcher.join()
    assert tid != threading.get_native_id()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0      # the caller keeps its own
    assert seen and all(nice == 7 and ioprio == 3 << 13 for _, nice, ioprio in seen)
    assert len({t for t, _, _ in seen}) >= 2, "zstd's worker threads did not run at the persist's priority"


def test_bounded_hands_back_the_workers_exception():
    def boom():
        raise StorageError("disk gone")
    with pytest.raises(StorageError, match="disk gone"):
        bounded(Priority(), boom)


def test_codec_settings_are_checked_with_the_key_named():
    for args, key in [(("lz4", 1, 1), "compression"), (("zstd", 0, 1), "compression_level"),
                      (("zstd", 3, 0), "compression_threads")]:
        with pytest.raises(ConfigError, match=f"key '{key}'"):
            compression.from_settings(*args)
    assert compression.from_settings("off", 99, 0) is PLAIN


# ---- the rank's staging life cycle ---------------------------------------------------------------------
def test_a_periodic_capture_dumps_to_staging_and_persists_after_the_thaw(tmp_path, monkeypatch):
    tree = Tree()
    try:
        store, staging = JobStore(tmp_path / "images", "c", 5), Staging(tmp_path / "staging")
        p = rank_runner(store, staging, tree, images(1))
        thawed_before_persist = []

        def spy(*a, **kw):
            thawed_before_persist.append(p.ctx.cgroup.state() == "THAWED")
            return persist_rank(*a, **kw)
        monkeypatch.setattr(persist, "persist_rank", spy)
        p.prepare(1)
        assert (staging.root / "c.5" / "capture-000001-batch.0").is_dir()
        p.capture(1, final=False)
        assert not store.rank_dir(1, "batch", 0).exists()         # nothing in the store while frozen
        reply = p.resume(1)
        assert thawed_before_persist == [True]
        assert 0 < reply["bytes"] < reply["raw_bytes"]
        assert "persist" in p.state.timings and p.state.timings["expected_mib"] >= 0
        store.commit(1, {"batch.0": {"kind": "image"}}, "interval", 2)
        assert read_back(store, 1, tmp_path / "back") == images(1)
    finally:
        tree.close()


@pytest.fixture
def committed(tmp_path):
    """A rank runner (stand-in CRIU and freezer, real store and staging) with epoch 1 committed."""
    tree = Tree()
    store, staging = JobStore(tmp_path / "images", "c", 5), Staging(tmp_path / "staging")
    p = rank_runner(store, staging, tree, images(2))
    capture(p, 1)
    yield store, staging, p
    tree.close()


def test_restore_unpacks_into_staging_and_removes_it_after_criu(committed):
    store, staging, p = committed
    pid, manifest = p.restore(replace(p.ctx, root_pid=None), 1, [0, 1, 2])
    assert pid == os.getpid() and manifest.capture.tree.kind == "image"
    assert p.ctx.criu.restored == images(2)
    assert p.ctx.criu.restored_from.parent == staging.root / "c.5"
    assert settled(staging) == []


def test_restore_refuses_when_staging_cannot_hold_the_unpacked_images(committed, monkeypatch):
    store, staging, p = committed
    monkeypatch.setattr(rank_images, "free_bytes", lambda path: 1000)
    with pytest.raises(RestoreError, match=r"staging area \(.*\) has \d+ B free; unpacking epoch 1 needs [\d.]+ KiB"):
        p.restore(replace(p.ctx, root_pid=None), 1, [0, 1, 2])
    assert p.ctx.criu.restored is None


def test_a_failed_periodic_persist_leaves_the_epoch_uncommitted_and_staging_clean(committed, monkeypatch):
    store, staging, p = committed

    def broken(*a, **kw):
        raise StorageError("writing rank.json failed: Input/output error")
    monkeypatch.setattr(persist, "persist_rank", broken)
    p.prepare(2)
    p.capture(2, final=False)
    with pytest.raises(SlurmckptError, match="rank.json failed"):
        p.resume(2)
    assert p.failed_stage == "persist" and p.ctx.cgroup.state() == "THAWED"
    p.abort(2)
    store.empty_trash()
    assert not store.epoch_dir(2).exists() and [e["epoch"] for e in store.committed()] == [1]
    assert settled(staging) == []


def test_stored_files_are_standard_zstd_with_raw_frames_where_compressing_saves_little(tmp_path):
    """Frames of FRAME bytes each: compressible ones zstd-compressed, incompressible ones as zstd raw blocks;
    any zstd decoder reads the whole file (the index frames are skippable), ours in order on many threads,
    into a file equal to the original where the zero frame is a hole (no blocks allocated for it)."""
    import io

    import zstandard
    chunk = compression.FRAME
    data = bytes(chunk) + os.urandom(chunk) + (b"log line %d\n" * chunk)[:chunk] + bytes(chunk) + os.urandom(123)
    class Memory(io.BytesIO):
        def digest(self):
            return ""
    sink = Memory()
    Zstd(1, 2).encode(io.BytesIO(data), sink, len(data))
    stored = sink.getvalue()
    assert chunk + 123 < len(stored) < len(data) // 3 + 4096      # the random frames are stored raw
    standard = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=True).read()
    assert standard == data
    out = tmp_path / "unpacked"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    back = compression.Sink(fd, str(out), hashed=False)
    Zstd().decode(io.BytesIO(stored), back)
    os.ftruncate(fd, back.size)
    os.close(fd)
    assert back.size == len(data) and out.read_bytes() == data
    assert os.stat(out).st_blocks * 512 <= 2 * chunk + (1 << 20)        # both zero frames are holes
    assert compression.raw_frame(b"abc")[4] == 0xE0


def test_a_raw_frame_is_read_in_place_and_a_damaged_one_goes_to_zstd_which_refuses_it():
    """A frame `raw_frame` wrote comes back as views of its blocks; one whose block type, length or size
    disagrees is not taken as raw, and zstd's decoder then rejects it."""
    import io
    data = os.urandom(300 << 10)
    frame = compression.raw_frame(data)
    assert b"".join(compression.raw_blocks(frame, len(data))) == data
    assert compression.raw_blocks(frame, len(data) + 1) is None
    assert compression.raw_blocks(frame[:-1], len(data)) is None
    bad = bytearray(frame)
    bad[13] |= 0b010                                  # the first block claims RLE
    assert compression.raw_blocks(bytes(bad), len(data)) is None
    stored = compression._index(len(bad), len(data)) + bytes(bad)
    class Memory(io.BytesIO):
        def digest(self):
            return ""
    with pytest.raises(ValueError):
        Zstd().decode(io.BytesIO(stored), Memory())


def test_raw_files_are_linked_after_an_in_place_check_and_a_damaged_one_is_refused(store, tmp_path, monkeypatch):
    """On another node (or after the file changed) a raw file is hashed where it is, then linked, not
    copied; a corrupt one is refused before anything is linked."""
    files = {"pages-1.img": os.urandom(1 << 20)}
    persist_rank(store, 1, "0", 0, staged(tmp_path, files), Capture(), Zstd(1, 1))
    monkeypatch.setattr(persist.socket, "gethostname", lambda: "another-node")
    back = tmp_path / "back"
    back.mkdir()
    materialize(store, 1, "0", 0, back)
    assert (back / "pages-1.img").is_symlink() and (back / "pages-1.img").read_bytes() == files["pages-1.img"]
    path = store.rank_dir(1, "0", 0) / "pages-1.img"
    with open(path, "r+b") as f:         # flip one byte (writing a fixed value may leave it as it was)
        f.seek(4096)
        byte = f.read(1)[0]
        f.seek(4096)
        f.write(bytes([byte ^ 0xFF]))
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(StorageError, match="pages-1.img corrupt"):
        materialize(store, 1, "0", 0, again)
    assert list(again.iterdir()) == []
