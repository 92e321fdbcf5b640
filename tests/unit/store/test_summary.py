"""The job summary (summary.py) against its user and other users: root's file, which the job's uid alone may
read (an ACL) and nobody but root may write, chmod, replace or remove; and its readers (root's CLI among
them) take only a root-owned file of bounded size and only the fields and types it was written with, so a
deep, huge, foreign or misshapen file neither crashes them nor steers them. Run as root: the users are
forked children."""
from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmckpt.store import summary
from slurmckpt.store.jobstore import JobStore

JOB_UID, OTHER_UID = 60011, 60012


def _open_root() -> Path:
    """A directory tree every uid may enter (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="slurmckpt-test-"))
    d.chmod(0o755)
    atexit.register(shutil.rmtree, d, True)
    return d


def _published(root: Path) -> Path:
    store = JobStore(root / "images", "c", 7)
    store.ensure()
    summary.update_run(store, {"restart_count": 1, "interval_s": 600})
    return summary.publish(store, str(root / "summaries"), uid=JOB_UID)


def _as(uid: int, act) -> list:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(act()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def _errno(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))


@pytest.mark.system
def test_only_the_jobs_user_reads_the_summary_and_nobody_but_root_can_change_it():
    assert os.geteuid() == 0, "run as root: the users are forked children"
    root = _open_root()
    out = _published(root)
    st = os.lstat(out)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o440)
    acl = os.getxattr(out, summary.ACL_XATTR)
    entries = {struct.unpack_from("<HHI", acl, 4 + 8 * i) for i in range((len(acl) - 4) // 8)}
    assert (0x02, 4, JOB_UID) in entries and (0x20, 0, 0xFFFFFFFF) in entries and (0x04, 0, 0xFFFFFFFF) in entries

    def attack() -> list:
        data = summary.read(str(root / "summaries"), "c", 7)
        return [data and data["run"], _errno(lambda: os.open(out, os.O_WRONLY)), _errno(lambda: os.chmod(out, 0o600)),
                _errno(lambda: os.rename(out, out.with_name("x"))), _errno(lambda: os.unlink(out)),
                _errno(lambda: os.open(out.with_name("8.json"), os.O_WRONLY | os.O_CREAT, 0o644))]
    assert _as(JOB_UID, attack) == [{"restart_count": 1, "interval_s": 600}, "EACCES", "EPERM", "EACCES", "EACCES",
                                    "EACCES"]
    assert _as(OTHER_UID, attack)[0] is None                     # another user reads nothing
    assert _as(OTHER_UID, lambda: _errno(lambda: open(out).read())) == "EACCES"


def _write(path: Path, content: bytes | dict, uid: int = 0, mode: int = 0o440) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    os.chown(path, uid, 0)
    os.chmod(path, mode)


GOOD = {"version": 1, "cluster": "c", "job": 7, "updated_at": 1.5, "note": "n",
        "epochs": [{"epoch": 3, "committed_at": 1.0, "trigger": "interval", "ranks": 1, "bytes": 9, "nodes": ["n1"]}],
        "withdrawn": [], "failed_captures": [], "run": {"restart_count": 2}}


@pytest.mark.parametrize("content,uid,mode", [
    (GOOD, JOB_UID, 0o400),                          # the user's own file (what an older release wrote)
    (GOOD, 0, 0o464),                                # root's, but group-writable
    ({**GOOD, "job": 8}, 0, 0o440),                  # another job's summary put in its place
    ({**GOOD, "cluster": "other"}, 0, 0o440),
    (b"[" * 200_000, 0, 0o440),                       # deep nesting: RecursionError in json
    (b'{"cluster": "c", "job": 7, "pad": "' + b"x" * (2 << 20) + b'"}', 0, 0o440),   # over MAX_BYTES
    (b"not json", 0, 0o440), (b"[1, 2]", 0, 0o440)])
@pytest.mark.system
def test_a_summary_root_did_not_write_as_it_is_read_as_none(tmp_path, content, uid, mode):
    _write(tmp_path / "c" / "7.json", content, uid, mode)
    assert summary.read(str(tmp_path), "c", 7) is None
    _write(tmp_path / "c" / "7.json", GOOD)
    assert summary.read(str(tmp_path), "c", 7)["epochs"][0]["epoch"] == 3


@pytest.mark.system
def test_fields_of_the_wrong_type_are_left_out_so_no_reader_trips_on_them(tmp_path):
    _write(tmp_path / "c" / "7.json", {
        "cluster": "c", "job": 7, "note": ["x"], "updated_at": "soon",
        "epochs": [{"epoch": "1"}, {"epoch": True}, {"epoch": 4, "bytes": "big", "nodes": "n1", "trigger": {"a": 1},
                                                     "committed_at": float("inf")}, "junk"],
        "withdrawn": [{"epoch": [1], "reason": 5}],
        "failed_captures": [{"epoch": 5}, {"epoch": 6, "at": 1.0, "rank": "batch.0", "node": "n", "final": 1,
                                          "trigger": "t", "stage": "dump", "reason": "r", "seen_by": "agent"}],
        "run": {"restart_count": "2", "disabled": ["x"], "interval_s": 60, "policy": {"settings": {"a": [1]},
                                                                                     "allowed": True}}})
    data = summary.read(str(tmp_path), "c", 7)
    assert data["epochs"] == [{"epoch": 4, "committed_at": None, "trigger": None, "ranks": 0, "bytes": 0, "nodes": []}]
    assert data["withdrawn"] == [{"epoch": None, "at": None, "reason": None}]
    assert data["failed_captures"] == [] and data["note"] is None and data["updated_at"] is None
    assert data["run"] == {"interval_s": 60, "policy": {"settings": {}, "allowed": True}}


@pytest.mark.system
def test_status_survives_a_deep_or_misshapen_summary(tmp_path, monkeypatch):
    """`slurmckpt status JOB` crashed (RecursionError) on a deeply nested summary and on fields of another
    type; it now shows the job without what it cannot read."""
    from fake_slurm import FakeSlurm, squeue_answer, squeue_line
    from slurmckpt.cli import cli, lookup
    (tmp_path / "slurmckpt.yaml").write_text(f"summary_dir: {tmp_path}/summaries\n")
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    lookup.cluster.cache_clear()
    FakeSlurm(squeue=squeue_answer(squeue_line(7, restarts=2)), scontrol="ClusterName = c\n").install(monkeypatch)
    for content in (b"[" * 200_000, {"cluster": "c", "job": 7, "epochs": "x", "run": [1], "failed_captures": 5},
                    {"cluster": "c", "job": 7, "epochs": [{"epoch": 1, "bytes": "x"}]}):
        _write(tmp_path / "summaries" / "c" / "7.json", content)
        r = CliRunner().invoke(cli, ["status", "7"])
        assert r.exit_code == 0 and r.exception is None, (content if isinstance(content, dict) else "deep", r.output)
