"""The capture's record (store/record.py): format 1 as real captures wrote it, read and written back the same,
and what this release cannot read refused by name."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slurmckpt.errors import StorageError
from slurmckpt.store.jobstore import RANK_MANIFEST, JobStore
from slurmckpt.rank.sharing import netlock
from slurmckpt.store.record import (FORMAT, Capture, Draft, Files, HandedSocket, OutputSnapshot, RankRecord, ScriptFd,
                                    Sockets, StdioFd, Tree)

FIXTURES = Path(__file__).parents[1] / "fixtures"
# rank.json of a real final capture (tests/integration/test_kill_window.py on the 26.05 cluster): the batch
# step of job 10, epoch 4, its script open at offset 66, stdout and stderr on one regular file
FINAL = FIXTURES / "rank-v1-final-batch.json"
# an MPICH ring of 2 ranks started by srun --mpi=pmi2 on one node (tests/integration/test_mpi.py, 22.05): its
# first periodic capture, the step's two ranks (PMI socket, TCP between them) and the replayed batch step
MPI_RANK0, MPI_RANK1 = FIXTURES / "rank-v1-mpich-0.0.json", FIXTURES / "rank-v1-mpich-0.1.json"
MPI_BATCH = FIXTURES / "rank-v1-mpich-batch-replay.json"
ALL = (FINAL, MPI_RANK0, MPI_RANK1, MPI_BATCH)


def _on_disk(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_real_format_1_record_reads_with_its_values() -> None:
    rec = RankRecord.from_json(_on_disk(FINAL))
    assert rec.format == FORMAT == 1
    t = rec.capture.tree
    assert (t.kind, t.processes, t.node, t.uid, t.mntns, t.step_token) == ("image", 3, "cinode", 41001, False, "")
    assert t.captured_at == 1796613071.9178894
    out = "/var/tmp/slurmckpt-work/ckptuser1/kill-window/slurm-10.out"
    f = rec.capture.files
    assert f.stdio == (StdioFd(0, "/dev/null", "dev/null", False, 0), StdioFd(1, out, out[1:], True, 7708),
                       StdioFd(2, out, out[1:], True, 7708))
    assert f.batch_script == (ScriptFd("var/lib/slurmckpt-cluster/spool/node1/job00010/slurm_script", 66),)
    assert f.truncate == f.ghosts == f.shared == f.shm == () and f.external == ()
    assert rec.capture.outputs == (OutputSnapshot(1, out, 7708, "output-1.snap", ((0, 7708),)),
                                   OutputSnapshot(2, out, 7708, "output-1.snap", ((0, 7708),)))
    s = rec.capture.sockets
    assert s == Sockets(tcp_ports={"listeners": [], "own": []})
    assert rec.capture.gpu.state is None and rec.capture.gpu.host_copy == ()
    assert rec.capture.staged_bytes == 2156580943            # a final capture: what it handed over
    assert rec.capture.timings["criu_dump"] == 1.0357436970007257 and rec.capture.timings["expected_mib"] == 2056.7
    seal = rec.seal
    assert (seal.job, seal.step, seal.rank, seal.epoch, seal.sealed_on) == (10, "batch", 0, 4, "cinode")
    assert seal.files["cgroup.img"]["stored"] == "cgroup.img.zst" and seal.files["cgroup.img"]["raw_size"] == 506
    assert seal.raw_bytes() == sum(e.get("raw_size", e["size"]) for e in _on_disk(FINAL)["files"].values())


def test_a_real_mpi_rank_reads_with_its_pmi_socket_and_tcp_to_the_other_rank() -> None:
    rec = RankRecord.from_json(_on_disk(MPI_RANK0))
    assert (rec.seal.job, rec.seal.step, rec.seal.rank, rec.seal.epoch) == (259, "0", 0, 1)
    assert rec.capture.tree.kind == "image" and rec.capture.tree.processes == 2 and rec.capture.staged_bytes is None
    s = rec.capture.sockets
    assert s.pmi == (HandedSocket("socket:[2858843]", 2858843),) and s.srun_standins == ()
    assert s.tcp_ranks == (("127.0.0.1:45518", "127.0.0.1:58201", "0", 1),
                           ("10.77.0.1:52751", "10.77.0.1:52402", "0", 1))
    assert s.tcp_nodes == () and s.tcp_close == ()
    assert s.tcp_ports["listeners"] == [["10.77.0.1", 52751], ["127.0.0.1", 42985]]
    assert rec.capture.files.stdio[1] == StdioFd(1, "pipe:[2858850]", "pipe:[2858850]", False, 0)
    assert rec.capture.outputs == ()


def test_both_ends_recorded_by_the_two_ranks_are_the_connections_a_restore_holds() -> None:
    """What the restore's tcp-hold stage does with the records (rank/sharing/netlock.py confirmed)."""
    records = {(r.seal.step, r.seal.rank): r for r in map(RankRecord.from_json, map(_on_disk, (MPI_RANK0, MPI_RANK1)))}
    mine = records[("0", 0)].capture.sockets.tcp_ranks
    held = netlock.confirmed(mine, "0", 0, lambda step, rank: records[(step, rank)].capture.sockets.tcp_ranks)
    assert held == [["127.0.0.1:45518", "127.0.0.1:58201"], ["10.77.0.1:52751", "10.77.0.1:52402"]]


def test_a_real_replayed_batch_step_reads_as_a_replay_with_its_output_snapshot() -> None:
    rec = RankRecord.from_json(_on_disk(MPI_BATCH))
    assert rec.capture.tree.kind == "replay" and not rec.capture.tree.imaged
    assert rec.capture.sockets == Sockets()
    assert [(o.fd, o.size, o.ranges) for o in rec.capture.outputs] == [(1, 2712, ((0, 2712),)), (2, 2712, ((0, 2712),))]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_format_1_is_written_back_key_for_key_as_it_was_read(path: Path) -> None:
    """The layout on disk is today's: what real captures of the release before the typed record wrote
    comes back identical (a replay without tcp_nodes/tcp_close, a periodic capture without bytes), so
    images committed by an earlier release and this one's are one format."""
    raw = _on_disk(path)
    assert RankRecord.from_json(raw).to_json() == raw


def test_to_json_and_from_json_round_trip() -> None:
    rec = RankRecord.from_json(_on_disk(FINAL))
    rich = dataclasses.replace(rec, capture=dataclasses.replace(
        rec.capture, tree=dataclasses.replace(rec.capture.tree, step_token="0123456789abcdef", mntns=True),
        sockets=Sockets(tcp_ranks=(("127.0.0.1:5000", "127.0.0.1:40000", "0", 1),),
                        tcp_nodes=(("10.0.0.1:6000", "10.0.0.2:41000"),), tcp_close=(17, 21),
                        tcp_ports={"listeners": [["0.0.0.0", 5000]], "own": []}),
        staged_bytes=None))
    again = RankRecord.from_json(json.loads(json.dumps(rich.to_json())))
    assert again == rich
    assert RankRecord.from_json(rec.to_json()) == rec


def test_a_record_without_a_version_key_is_format_1() -> None:
    raw = _on_disk(FINAL)
    del raw["version"]
    assert RankRecord.from_json(raw) == RankRecord.from_json(_on_disk(FINAL))


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_an_unknown_format_is_refused_by_name(version: object) -> None:
    raw = {**_on_disk(FINAL), "version": version}
    with pytest.raises(StorageError, match=f"rank.json is of format {version!r}; this slurmckpt reads format"):
        RankRecord.from_json(raw)


def test_the_store_refuses_an_unknown_format_as_it_refuses_any_unreadable_rank(tmp_path: Path) -> None:
    """A restore treats it like any rank it cannot read: StorageError, naming the epoch and the rank."""
    store = JobStore(tmp_path, "c", 10)
    rdir = store.rank_dir(4, "batch", 0)
    rdir.mkdir(parents=True)
    (rdir / RANK_MANIFEST).write_text(json.dumps({**_on_disk(FINAL), "version": 2}))
    with pytest.raises(StorageError, match=r"format 2.*epoch=4 rank=batch\.0"):
        store.read_rank_manifest(4, "batch", 0)


def test_a_malformed_entry_is_a_storage_error_not_a_crash() -> None:
    raw = _on_disk(FINAL)
    raw["stdio"] = [{"fd": "one"}]
    with pytest.raises(StorageError, match="rank.json unreadable"):
        RankRecord.from_json(raw)


def test_an_older_release_that_named_only_listening_ports_reads_as_wildcard_listeners() -> None:
    raw = {k: v for k, v in _on_disk(FINAL).items() if k != "tcp_ports"}
    assert RankRecord.from_json({**raw, "tcp_listen": [5000]}).capture.sockets.tcp_ports == {
        "listeners": [["0.0.0.0", 5000]]}


def test_sections_are_frozen_and_take_no_field_they_do_not_declare() -> None:
    """What mypy checks in the code (a misspelt field is a type error) holds at run time too, and the record
    writes exactly the keys a real capture wrote, no more."""
    tree = Tree()
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.kind = "replay"            # type: ignore[misc]
    with pytest.raises(TypeError):
        Tree(kindd="image")            # type: ignore[call-arg]
    for section in (Tree, Files, Sockets, Capture, RankRecord, StdioFd, OutputSnapshot, ScriptFd):
        assert section.__dataclass_params__.frozen, section       # type: ignore[attr-defined]
    for path in ALL:
        assert set(RankRecord.from_json(_on_disk(path)).to_json()) == set(_on_disk(path))


def test_a_draft_builds_the_record_only_once_its_record_stage_ran() -> None:
    draft = Draft()
    with pytest.raises(StorageError, match="record stage did not run"):
        draft.whole({})
    draft.tree, draft.files, draft.sockets = Tree(kind="replay"), Files(), Sockets()
    whole = draft.whole({"record": 0.01})
    assert whole.to_json()["kind"] == "replay" and "tcp_nodes" not in whole.to_json()   # as a replay wrote it
    assert whole.timings == {"record": 0.01} and whole.staged_bytes is None
