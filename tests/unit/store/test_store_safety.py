"""Nothing committed is lost: ENOSPC at every write of a capture on a small real file system, kill -9 of the
capturing process at every step, and concurrent commits from several processes. After each, the newest
earlier commit still verifies and reads back byte for byte. Root only: these mount size-limited tmpfs."""
from __future__ import annotations

from dataclasses import replace

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from slurmckpt.store import space
from slurmckpt.store import reclaim
from slurmckpt.store import durable
from slurmckpt.errors import SlurmckptError, StorageError
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from smallfs import PAGE, free, leave_free, tmpfs
from store_harness import Tree, capture, images, leftovers, rank_runner, read_back, settled


@pytest.fixture
def fs(tmp_path):
    """A 4 MiB store and a roomy staging area, both real tmpfs."""
    with tmpfs(tmp_path / "store", 4 << 20) as store_fs, tmpfs(tmp_path / "staging", 64 << 20) as staging_fs:
        tree = Tree()
        try:
            yield store_fs, staging_fs, tree
        finally:
            tree.close()


def committed_epochs(store: JobStore) -> list[int]:
    return [e["epoch"] for e in store.committed()]


@pytest.mark.system
def test_enospc_at_every_write_of_a_capture_keeps_the_previous_commit(fs, tmp_path, monkeypatch):
    """Free space is raised one page at a time from nothing: every write of the second capture (the store's
    epoch's allocation, the reservation, each persisted image, rank.json, the previous manifest, the manifest) fails in turn with
    a real ENOSPC, until the capture fits. Each failure is a clear StorageError/CaptureError, leaves no temp
    file, commits nothing, leaves staging empty and the tree thawed; epoch 1 reads back exactly."""
    store_fs, staging_fs, tree = fs
    store, staging = JobStore(store_fs, "c", 7), Staging(staging_fs / "s")
    first = images(1)
    p = rank_runner(store, staging, tree, first)
    capture(p, 1)
    p.ctx.criu.files = images(2)
    monkeypatch.setattr(space, "expected", lambda memory, previous, copies=(): space.Need(0, 0))   # grew after the check
    failed_at: set[str] = set()
    for room in range(0, 2 << 20, PAGE):
        filler = leave_free(store_fs, room)
        try:
            epoch = store.allocate_epoch(1, lease_s=600, owner="test")
        except SlurmckptError as e:
            failed_at.add("allocation" if ".lease" in str(e) or "allocated-epoch" in str(e) else str(e))
            filler.unlink()
            assert committed_epochs(store) == [1] and sorted(store.job_dir.glob("epoch-*")) == [store.epoch_dir(1)]
            continue
        try:
            capture(p, epoch)
        except SlurmckptError as e:
            failed_at.add(_what(str(e)))
            p.abort(epoch)                         # what the coordinator sends after any failure
            assert committed_epochs(store) == [1]
            assert p.ctx.cgroup.state() == "THAWED"
            filler.unlink()
            store.empty_trash()
            assert not store.epoch_dir(epoch).exists()
            assert read_back(store, 1, tmp_path / "back") == first
            assert leftovers(store_fs) == [] and settled(staging) == []
            continue
        filler.unlink()
        assert committed_epochs(store) == [epoch, 1]
        assert read_back(store, epoch, tmp_path / "back") == images(2) != first
        assert read_back(store, 1, tmp_path / "back") == first
        break
    else:
        raise AssertionError("the capture never fitted")
    # (a one-page file can be skipped over: tmpfs gives back a replaced file's page a moment later)
    assert {"allocation", "reservation", "pages-1.img", "pages-2.img", "rank.json", "manifest.json.prev",
            "manifest.json"} <= failed_at, failed_at


def _what(message: str) -> str:
    for name in ("manifest.json.prev", "manifest.json", "rank.json", "pages-1.img", "pages-2.img",
                 "core-1.img", "inventory.img", "dump.log"):
        if name in message:
            return name
    return "reservation" if "stage space failed" in message else message


@pytest.mark.system
def test_enospc_in_staging_refuses_the_dump_and_keeps_the_previous_commit(fs, tmp_path, monkeypatch):
    store_fs, staging_fs, tree = fs
    store, staging = JobStore(store_fs, "c", 7), Staging(staging_fs / "s")
    p = rank_runner(store, staging, tree, images(1))
    capture(p, 1)
    monkeypatch.setattr(space, "expected", lambda memory, previous, copies=(): space.Need(0, 0))
    p.ctx.criu.files = images(2, kib=256)
    filler = leave_free(staging_fs, 128 << 10)
    with pytest.raises(SlurmckptError, match="stage dump failed: .*No space left"):
        capture(p, 2)
    filler.unlink()
    assert committed_epochs(store) == [1] and p.ctx.cgroup.state() == "THAWED"
    assert read_back(store, 1, tmp_path / "back") == images(1)
    assert settled(staging) == []


# ---- kill -9 ----------------------------------------------------------------------------------------------
COUNTED = ("open", "write", "fsync", "rename", "mkdir", "unlink")


def _run_child(store: JobStore, staging: Staging, tree: Tree, epoch: int, kill_at: int) -> int:
    """Fork a process that captures and commits `epoch`, SIGKILLing itself at its `kill_at`-th file-system
    call (0: never). Returns the number of calls it made (when not killed) or -1."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                  # the child: no pytest machinery past this point
        os.close(r)
        calls, main = [0], threading.get_ident()
        for name in COUNTED:
            real = getattr(os, name)

            def counted(*a, _real=real, **kw):
                if threading.get_ident() == main:         # background deletions are not the capture's steps
                    calls[0] += 1
                    if calls[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                return _real(*a, **kw)
            setattr(os, name, counted)
        try:
            p = rank_runner(store, staging, tree, images(epoch))
            p.ctx = replace(p.ctx, policy=p.ctx.policy.__class__(staging, p.ctx.policy.codec, None, p.ctx.policy.quotas))  # persist in-thread
            capture(p, epoch)
            os.write(w, str(calls[0]).encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = os.read(r, 64)
    os.close(r)
    return int(out) if os.WIFEXITED(status) and out else -1


@pytest.mark.system
def test_kill_9_at_every_step_of_a_capture_and_commit(fs, tmp_path):
    """The capturing process dies (SIGKILL) at each of its file-system calls in turn: reservation, staging,
    persist, rank.json, previous manifest, manifest, pruning. Afterwards the newest earlier commit verifies
    and reads back exactly, the epoch being captured is either committed whole or not at all, the lock is
    free, and garbage collection leaves no trace of the dead attempt."""
    store_fs, staging_fs, tree = fs
    store, staging = JobStore(store_fs, "c", 7), Staging(staging_fs / "s")
    for epoch in (1, 2):               # each attempt then also prunes the oldest of two epochs
        capture(rank_runner(store, staging, tree, images(epoch)), epoch)
    total = _run_child(store, staging, tree, 3, kill_at=0)
    assert total > 30 and committed_epochs(store) == [3, 2]
    newest, seen = 3, {"committed": 0, "not": 0}
    for kill_at in range(1, total + 1):
        epoch = newest + 1
        assert _run_child(store, staging, tree, epoch, kill_at) == -1
        epochs = committed_epochs(store)
        if epochs[0] == epoch:                    # died after the manifest's rename: committed whole
            seen["committed"] += 1
            assert read_back(store, epoch, tmp_path / "back") == images(epoch)
            newest = epoch
        else:
            seen["not"] += 1
            assert epochs[0] == newest
        assert read_back(store, newest, tmp_path / "back") == images(newest)
        later = time.time() + 10 * reclaim.GRACE_S + 4000
        reclaim.collect_job(store, now=later, wait=True)
        reclaim.collect_staging(staging, now=later)
        assert leftovers(store_fs) == [] and staging.areas() == []
        assert sorted(p.name for p in store.job_dir.iterdir() if p.name.startswith("epoch-")) == \
            [f"epoch-{e:06d}" for e in sorted(committed_epochs(store))]
    assert seen["committed"] >= 1 and seen["not"] > total // 2
    with store.lock():                            # the dead processes' locks went with them
        pass


# ---- concurrent commits --------------------------------------------------------------------------------------
def _committer(root: Path, staging_root: Path, step: str, rounds: int, tree: Tree) -> None:
    store, staging = JobStore(root, "c", 9), Staging(staging_root)
    p = rank_runner(store, staging, tree, images(int(step)), step=step)
    for _ in range(rounds):
        epoch = store.allocate_epoch(1, lease_s=600, owner=f"step {step}")
        p.ctx.criu.files = images(epoch)
        capture(p, epoch)


def test_concurrent_commits_of_two_steps_lose_nothing(tmp_path):
    """Two processes (two steps of one job, each with its own coordinator) allocate, capture and commit at
    once, with a third withdrawing epochs meanwhile: numbers never collide, no commit overwrites another,
    keep-2 keeps each step's two newest, and every listed epoch reads back exactly."""
    tree = Tree()
    root, staging_root = tmp_path / "store", tmp_path / "staging"
    store = JobStore(root, "c", 9)
    store.ensure()
    kids = []
    try:
        for step in ("1", "2"):
            pid = os.fork()
            if pid == 0:
                try:
                    _committer(root, staging_root, step, 12, tree)
                    os._exit(0)
                except BaseException as e:  # noqa: BLE001 - reported through the exit code
                    os.write(2, f"committer {step}: {e!r}\n".encode())
                    os._exit(1)
            kids.append(pid)
        rejected, codes = [], {}
        while len(codes) < len(kids):
            for k in kids:
                if k not in codes and (done := os.waitpid(k, os.WNOHANG))[0]:
                    codes[k] = os.waitstatus_to_exitcode(done[1])
            time.sleep(0.01)
            epochs = store.committed()
            if len(rejected) < 3 and len(epochs) > 2 and epochs[-1]["epoch"] < 10:
                if store.reject(epochs[-1]["epoch"], "test"):
                    rejected.append(epochs[-1]["epoch"])
        assert list(codes.values()) == [0, 0]
    finally:
        tree.close()
    manifest = store.read_manifest()
    by_step: dict[str, list[int]] = {}
    for e in manifest["epochs"]:
        (name,) = e["ranks"]
        by_step.setdefault(name, []).append(e["epoch"])
        assert read_back(store, e["epoch"], tmp_path / "back", step=name.split(".")[0]) == images(e["epoch"])
    assert sorted(by_step) == ["1.0", "2.0"] and all(len(v) == 2 for v in by_step.values())
    assert store._counter() == 24                     # 24 numbers handed out, none twice
    assert not set(rejected) & {e["epoch"] for e in manifest["epochs"]}


def test_lock_is_exclusive_across_processes_and_nests_within_one(tmp_path):
    path = tmp_path / "lock"
    with durable.posix_lock(path):
        with durable.posix_lock(path):            # nested in this process: still held after the inner exit
            pass
        pid = os.fork()
        if pid == 0:
            try:
                with durable.posix_lock(path, timeout_s=0.3):
                    os._exit(1)
            except SlurmckptError:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    pid = os.fork()
    if pid == 0:
        with durable.posix_lock(path, timeout_s=2):
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.system
def test_store_refused_free_space_is_named(fs, tmp_path):
    """A capture that cannot fit is refused in PREPARE, before anything is frozen, naming the store."""
    store_fs, staging_fs, tree = fs
    store, staging = JobStore(store_fs, "c", 7), Staging(staging_fs / "s")
    p = rank_runner(store, staging, tree, images(1, kib=1024))
    capture(p, 1)
    filler = leave_free(store_fs, 256 << 10)
    try:
        with pytest.raises(SlurmckptError, match=r"image store \(.*\) has [\d.]+ KiB free"):
            p.prepare(2)
    finally:
        filler.unlink()
    assert p.ctx.cgroup.state() == "THAWED" and committed_epochs(store) == [1]
    assert free(store_fs) > 0


def test_an_unreachable_store_is_waited_for_and_then_named(tmp_path, monkeypatch):
    """While the store's file system answers ENOTCONN (a FUSE client whose server is down) the agent waits;
    it goes on as soon as the store answers, and past the limit it fails naming the store and the error.
    Any other error is not an outage and is left to the caller."""
    import errno as errno_
    from slurmckpt.store.durable import await_store
    calls, now = {"n": 0}, [0.0]

    def listdir(path):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError(errno_.ENOTCONN, "Transport endpoint is not connected")
        return []
    monkeypatch.setattr(os, "listdir", listdir)
    waited = await_store(tmp_path, 60, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert calls["n"] == 4 and waited == 6.0
    calls["n"], now[0] = 0, 0.0
    with pytest.raises(StorageError, match=r"did not answer for 4s \(Transport endpoint is not connected\)"):
        await_store(tmp_path, 4, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(PermissionError(errno_.EACCES, "no")))
    assert await_store(tmp_path, 60) == pytest.approx(0, abs=0.5)
