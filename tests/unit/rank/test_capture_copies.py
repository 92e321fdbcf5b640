"""What a capture copies besides criu's images (the task's output files, /dev/shm files the tree holds):
copied by their data, holes kept, counted in PREPARE's reservation and quotas, and never beyond what was
counted (sparse.py, output_snapshot.py, space.CopyBudget)."""
from __future__ import annotations

import os
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from slurmckpt.rank import fit
from slurmckpt.rank import output_snapshot
from slurmckpt.store import space
from slurmckpt.store import sparse
from slurmckpt.errors import CaptureError
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore
from smallfs import tmpfs
from store_harness import Tree, capture, images, rank_runner, read_back, settled

TIB = 1 << 40


@pytest.fixture
def shm_file():
    path = Path("/dev/shm") / f"slurmckpt-test-copies-{os.getpid()}"
    path.write_bytes(b"")
    yield path
    path.unlink(missing_ok=True)


def tree_with(stdout: Path, held: Path | None = None) -> Tree:
    """A stand-in tree whose stdout is `stdout` and which holds `held` open (not mapped)."""
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT, 0o600)
    fds = [os.open(held, os.O_RDWR)] if held else []
    try:
        return Tree(subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.DEVNULL, pass_fds=fds))
    finally:
        for fd in [out, *fds]:
            os.close(fd)


def test_sparse_file_copies_only_its_data_and_writes_back_with_its_holes(tmp_path: Path) -> None:
    src = tmp_path / "sparse"
    with open(src, "wb") as f:
        f.write(b"head")
        f.seek(TIB - 4)
        f.write(b"tail")
    charged: list[int] = []
    fd = os.open(src, os.O_RDONLY)
    try:
        ranges = sparse.copy_data(fd, tmp_path / "copy", TIB, charged.append, "sparse")
    finally:
        os.close(fd)
    assert sum(charged) == sum(length for _, length in ranges) == (tmp_path / "copy").stat().st_size
    assert (tmp_path / "copy").stat().st_size < 1 << 20, "the holes were copied"
    assert ranges[0][0] == 0 and ranges[-1][0] + ranges[-1][1] == TIB
    dst = os.open(tmp_path / "back", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)    # Slurm's append mode too
    try:
        with open(tmp_path / "copy", "rb") as copy:
            sparse.write_back(dst, copy.fileno(), ranges, TIB)
        st = os.fstat(dst)
        assert (st.st_size, os.pread(dst, 4, 0), os.pread(dst, 4, TIB - 4)) == (TIB, b"head", b"tail")
        assert st.st_blocks * 512 < 1 << 20, "the holes were written"
    finally:
        os.close(dst)


def test_a_copy_over_its_charge_is_refused_before_it_writes(tmp_path: Path) -> None:
    src = tmp_path / "dense"
    src.write_bytes(b"x" * (1 << 20))
    budget = space.CopyBudget(0)
    budget.spent = budget.limit - 1000
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(CaptureError, match=rf"capture refused: {src} \(size .*\) holds more data"):
            sparse.copy_data(fd, tmp_path / "copy", 1 << 20, lambda n: budget.charge(n, str(src), 1 << 20), str(src))
    finally:
        os.close(fd)
    assert not (tmp_path / "copy").exists()


@pytest.mark.system
def test_a_sparse_output_file_is_snapshotted_by_its_data_and_restored_with_its_holes(tmp_path: Path) -> None:
    """`truncate -s 1T` on the job's output: the capture used to copy the terabyte of zeros into staging
    and the store (here a 32 MiB staging file system: ENOSPC). Now it copies the data, and the restore gives
    back the same file, holes kept."""
    out = tmp_path / "slurm-7.out"
    with open(out, "wb") as f:
        f.write(b"line 1\n")
        f.truncate(TIB)
    assert out.stat().st_blocks * 512 < 1 << 20 and out.stat().st_size == TIB     # the attack costs nothing
    stack = ExitStack()
    tree = tree_with(out)
    try:
        store = JobStore(tmp_path / "images", "c", 7)
        staging = Staging(stack.enter_context(tmpfs(tmp_path / "staging", 32 << 20)) / "s")
        p = rank_runner(store, staging, tree, images(1))
        capture(p, 1)
        rank = store.read_rank_manifest(1, "batch", 0)
        assert [(o.fd, o.size) for o in rank.capture.outputs] == [(1, TIB)]
        assert rank.seal.files["output-1.snap"]["raw_size"] < 1 << 20
        back = read_back(store, 1, tmp_path / "back")
        assert settled(staging) == []
        new = os.open(tmp_path / "restored.out", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            (tmp_path / "unpacked").mkdir()
            (tmp_path / "unpacked" / "output-1.snap").write_bytes(back["output-1.snap"])
            output_snapshot.rewrite(rank.capture.outputs, tmp_path / "unpacked", [-1, new, -1])
            st = os.fstat(new)
            assert (st.st_size, os.pread(new, 7, 0)) == (TIB, b"line 1\n")
            assert st.st_blocks * 512 < 1 << 20
        finally:
            os.close(new)
    finally:
        tree.close()
        stack.close()


@pytest.mark.system
def test_a_held_dev_shm_file_counts_against_the_quota_and_is_named(tmp_path: Path, shm_file: Path,
                                                                    monkeypatch) -> None:
    """A /dev/shm file the tree holds open but not mapped is no part of its memory (RssShmem counts mapped
    pages only): the quota check did not see it, and the capture copied it as root all the same."""
    monkeypatch.setattr(fit, "tree_memory", lambda pids: 64 << 10)
    shm_file.write_bytes(os.urandom(2 << 20))
    tree = tree_with(tmp_path / "out", shm_file)
    try:
        store, staging = JobStore(tmp_path / "images", "c", 8), Staging(tmp_path / "staging")
        p = rank_runner(store, staging, tree, images(1), quotas=space.Quotas(job=1 << 20))
        with pytest.raises(CaptureError, match=rf"over quota_job .*; it copies {shm_file} \(2\.0 MiB\)"):
            p.prepare(1)
        assert p.ctx.cgroup.state() == "THAWED" and p.failed_stage == "space"
        assert staging.areas() == [] and not list(store.job_dir.glob("epoch-*/batch.0"))
        shm_file.write_bytes(b"small")           # within the quota: the copy is counted and taken
        capture(p, 2)
        assert read_back(store, 2, tmp_path / "back")["shm-0.data"] == b"small"
    finally:
        tree.close()


@pytest.mark.system
def test_what_grows_after_prepare_counted_it_is_refused_before_it_is_copied(tmp_path: Path, shm_file: Path,
                                                                            monkeypatch) -> None:
    monkeypatch.setattr(space, "COPY_MARGIN", 64 << 10)
    shm_file.write_bytes(b"small")
    tree = tree_with(tmp_path / "out", shm_file)
    try:
        store, staging = JobStore(tmp_path / "images", "c", 9), Staging(tmp_path / "staging")
        p = rank_runner(store, staging, tree, images(1))
        capture(p, 1)
        p.prepare(2)
        shm_file.write_bytes(os.urandom(1 << 20))          # filled by the user between the count and the copy
        with pytest.raises(CaptureError, match=rf"capture refused: {shm_file} \(size .*\) holds more data than "
                                               "this capture may copy"):
            p.capture(2, final=False)
        p.abort(2)
        assert p.ctx.cgroup.state() == "THAWED"
        assert [e["epoch"] for e in store.committed()] == [1] and settled(staging) == []
    finally:
        tree.close()


def test_a_deleted_file_the_tree_holds_is_counted_too(tmp_path: Path, shm_file: Path, monkeypatch) -> None:
    """Unlinked while held, the same /dev/shm file is copied by criu as a ghost file: counted all the same."""
    monkeypatch.setattr(fit, "tree_memory", lambda pids: 64 << 10)
    shm_file.write_bytes(os.urandom(2 << 20))
    tree = tree_with(tmp_path / "out", shm_file)
    shm_file.unlink()
    try:
        store, staging = JobStore(tmp_path / "images", "c", 10), Staging(tmp_path / "staging")
        p = rank_runner(store, staging, tree, images(1), quotas=space.Quotas(job=1 << 20))
        with pytest.raises(CaptureError, match=rf"over quota_job .*; it copies {shm_file} \(deleted\)"):
            p.prepare(1)
    finally:
        tree.close()
