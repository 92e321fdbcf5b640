"""Images bound to the job instance (instance.py), Slurm's view of the job (slurm/jobrecord.py: real
`squeue --json` shapes of 22.05 and 24.11), and the same-job filter of the pre-capture checks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slurmckpt.rank.sharing import ipc
from slurmckpt.task import defaults as task_defaults
from slurmckpt.store import instance
from slurmckpt.node import proctree
from slurmckpt.identity import TreeName
from slurmckpt.store.instance import JobInstance, claim, mismatch
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.jobrecord import expand_hostlist, gpu_indices, parse_record
from slurmckpt.store.jobstore import JobStore
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.store.record import Capture

# `squeue --json` on this cluster (Slurm 22.05.8, openapi/v0.0.38), trimmed to the fields read and the ones a
# user writes: a two-node GPU job named and run from a directory that spell out other Slurm fields (`scontrol
# show job -d -o` of this job held `JobName=x Partition=open QOS=free Restarts=7 ... Partition=low ...
# WorkDir=/tmp/x Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)`).
SPOOF_NAME, SPOOF_DIR = "x Partition=open QOS=free Restarts=7", "/tmp/x Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)"
SQUEUE_2205 = {
    "job_id": 43, "name": SPOOF_NAME, "user_id": 1001, "group_id": 1001, "partition": "low", "qos": "normal",
    "restart_cnt": 0, "submit_time": 1796511878, "job_state": "RUNNING",
    "gres_detail": ["gpu:2(IDX:0-1)", "gpu:1(IDX:1)"], "nodes": "node[1-2]",
    "job_resources": {"nodes": "node[1-2]", "allocated_cores": 2, "allocated_hosts": 2, "allocated_nodes": [
        {"sockets": {"0": {"cores": {"0": "allocated"}}}, "nodename": "node1", "cpus_used": 0, "memory_used": 0,
         "memory_allocated": 1024},
        {"sockets": {"0": {"cores": {"0": "allocated"}}}, "nodename": "node2", "cpus_used": 0, "memory_used": 0,
         "memory_allocated": 1024}]},
    "current_working_directory": SPOOF_DIR, "standard_output": "/tmp/o Restarts=9 GRES=gpu:8(IDX:0-7).out",
    "comment": "Partition=open QOS=free", "command": "x Restarts=7"}
# Slurm 24.11 (data_parser v0.0.42, the JOB_INFO and JOB_RES parsers of slurm-24-11-7-1; 25.11 and 26.05's
# v0.0.44/v0.0.45 read the same): typed GPUs on three nodes, a requeued job, flags after the base state.
SQUEUE_2411 = {
    "job_id": 5120, "name": "train", "user_id": 2001, "group_id": 3000, "partition": "gpu", "qos": "high",
    "restart_cnt": 2, "submit_time": {"set": True, "infinite": False, "number": 1796400902},
    "job_state": ["RUNNING", "CONFIGURING"], "nodes": "gpu[01-03]",
    "gres_detail": ["gpu:a100:2(IDX:0-1)", "gpu:a100:2(IDX:0-1)", "gpu:a100:1(IDX:1),gpu:v100:1(IDX:3)"],
    "job_resources": {"select_type": ["CORE", "MEMORY"], "cpus": 24, "threads_per_core": {
        "set": True, "infinite": False, "number": 1}, "nodes": {
        "count": 3, "select_type": ["AVAILABLE"], "list": "gpu[01-03]", "whole": False, "allocation": [
            {"index": 2, "name": "gpu03", "cpus": {"count": 8, "used": 0}, "memory": {"used": 0, "allocated": 65536},
             "sockets": []},
            {"index": 0, "name": "gpu01", "cpus": {"count": 8, "used": 0}, "memory": {"used": 0, "allocated": 65536},
             "sockets": []},
            {"index": 1, "name": "gpu02", "cpus": {"count": 8, "used": 0}, "memory": {"used": 0, "allocated": 65536},
             "sockets": []}]}}}
NO_GPU = {"job_id": 7, "user_id": 1002, "group_id": 1002, "partition": "debug", "qos": "normal", "restart_cnt": 1,
          "submit_time": 1796400000, "job_state": "RUNNING", "gres_detail": [],
          "job_resources": {"nodes": "node2", "allocated_nodes": [{"nodename": "node2"}]}}


def test_job_record_22_05_is_slurms_whatever_the_job_is_named() -> None:
    r = parse_record(SQUEUE_2205, 43)
    assert (r.uid, r.gid, r.restarts, r.state, r.partition, r.qos) == (1001, 1001, 0, "RUNNING", "low", "normal")
    assert r.submit_time == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(1796511878))   # as scontrol prints
    assert r.gpus == {"node1": [0, 1], "node2": [1]} and r.nodes == ("node1", "node2")


def test_job_record_24_11_typed_gpus_in_slurms_node_order() -> None:
    r = parse_record(SQUEUE_2411, 5120)
    assert (r.uid, r.gid, r.restarts, r.state, r.partition, r.qos) == (2001, 3000, 2, "RUNNING", "gpu", "high")
    assert r.gpus == {"gpu01": [0, 1], "gpu02": [0, 1], "gpu03": [1, 3]} and r.nodes == ("gpu01", "gpu02", "gpu03")
    bare = json.loads(json.dumps(SQUEUE_2411))
    bare["job_resources"]["nodes"]["allocation"] = []          # no per-node list: the hostlist, in order
    assert parse_record(bare, 5120).nodes == ("gpu01", "gpu02", "gpu03")


def test_job_record_without_gpus_pending_and_of_another_job() -> None:
    assert parse_record(NO_GPU, 7).gpus == {"node2": []}
    pending = {**NO_GPU, "job_state": ["PENDING"], "job_resources": None}
    assert (parse_record(pending, 7).nodes, parse_record(pending, 7).gpus) == ((), {})
    with pytest.raises(SlurmError, match="answered for job 43"):
        parse_record(SQUEUE_2205, 44)


@pytest.mark.parametrize("change", [
    {"user_id": "1001"}, {"user_id": True}, {"group_id": -1}, {"user_id": 4294967294}, {"restart_cnt": 1.0},
    {"restart_cnt": 70000}, {"submit_time": {"set": False, "infinite": False, "number": 0}},
    {"submit_time": "2026-12-05T23:04:38"}, {"job_state": "running"}, {"job_state": []}, {"partition": 5},
    {"gres_detail": ["gpu:2(IDX:0-1)"]}, {"gres_detail": ["gpu:2(IDX:N/A)", ""]},
    {"gres_detail": ["gpu:2(IDX:0-1) Nodes=node1", ""]}, {"gres_detail": ["gpu:1(IDX:9999)", ""]},
    {"job_resources": {"nodes": "x", "allocated_nodes": [{"nodename": "node 1"}, {"nodename": "node2"}]}},
    {"job_resources": {"nodes": "x", "allocated_nodes": [{"nodename": "node1"}, {"nodename": "node1"}]}},
    {"job_id": 43.0}])
def test_job_record_refuses_what_is_not_slurms_shape(change: dict) -> None:
    with pytest.raises(SlurmError):
        parse_record({**SQUEUE_2205, **change}, 43)


def test_gpu_indices_of_every_gres_detail_shape() -> None:
    for detail, want in [("", []), ("gpu:1(IDX:0)", [0]), ("gpu:a100:2(IDX:0-1)", [0, 1]),
                         ("gpu:4(IDX:0-1,3)", [0, 1, 3]), ("gpu:a100:1(IDX:0),gpu:v100:1(IDX:2)", [0, 2]),
                         ("shard:2(1/4,1/4),gpu:1(IDX:1)", [1]), ("mps:100(0/100,50/100)", [])]:
        assert gpu_indices(detail) == want, detail
    assert expand_hostlist("node[1-3,5],gpu07,n[08-10]") == ["node1", "node2", "node3", "node5", "gpu07",
                                                             "n08", "n09", "n10"]


def test_job_record_asks_squeue_json_for_the_trusted_id_and_picks_its_own_entry(monkeypatch) -> None:
    """22.05's squeue --json lists every job, whatever -j says; 22.05 exits 0 when slurmctld did not answer."""
    from fake_slurm import FakeSlurm
    from slurmckpt.slurm import control
    other = {**SQUEUE_2411, "job_id": 44}
    fake = FakeSlurm(squeue=json.dumps({"errors": [], "jobs": [other, SQUEUE_2205]})).install(monkeypatch)
    assert control.job_record(43).gpus == {"node1": [0, 1], "node2": [1]}
    assert fake.ran("squeue") == [["squeue", "--json", "-j", "43"]] and not fake.ran("scontrol")
    for answer in ({"errors": [{"error": "Unable to contact slurm controller", "errno": 1}], "jobs": []},
                   {"errors": [], "jobs": [SQUEUE_2205, SQUEUE_2205]}, {"jobs": {}}, [1]):
        FakeSlurm(squeue=json.dumps(answer)).install(monkeypatch)
        with pytest.raises(SlurmError):
            control.job_record(43)
    FakeSlurm(squeue='{"jobs": [{"job_id": 4' + "3" * 5000 + "}]}").install(monkeypatch)
    with pytest.raises(SlurmError):
        control.job_record(43)


def _me(uid: int = 1001, submit: str = "2026-12-03T11:26:17", restarts: int = 0, gid: int = 1001) -> JobInstance:
    return JobInstance("c", 43, uid, gid, submit, restarts)


def _store(tmp_path: Path) -> JobStore:
    store = JobStore(tmp_path, "c", 43)
    store.ensure()
    return store


def _foreign_epoch(store: JobStore, epoch: int = 1) -> None:
    (store.rank_dir(epoch, "batch", 0)).mkdir(parents=True)
    manifest = json.loads((store.job_dir / "manifest.json").read_text())
    manifest["epochs"].append({"epoch": epoch, "ranks": {"batch.0": {"kind": "image"}}})
    (store.job_dir / "manifest.json").write_text(json.dumps(manifest))


def test_first_write_binds_and_the_same_instance_is_accepted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert claim(store, _me()) is None
    assert store.read_manifest()["instance"] == {"cluster": "c", "job": 43, "uid": 1001, "gid": 1001,
                                                 "submit_time": "2026-12-03T11:26:17"}
    _foreign_epoch(store)
    assert claim(store, _me()) is None                                  # another rank of the same run
    # requeued: Slurm reset SubmitTime to the requeue's time; the store keeps the first run's
    later = _me(submit="2026-12-03T11:40:00", restarts=1)
    assert claim(store, later) is None and store.committed()
    assert store.read_manifest()["instance"]["submit_time"] == "2026-12-03T11:26:17"


@pytest.mark.parametrize("intruder, why", [
    (_me(uid=1002, restarts=1, submit="2026-12-03T12:00:00"), "uid 1001"),
    (_me(gid=1002, restarts=1, submit="2026-12-03T12:00:00"), "gid 1001"),
    (_me(submit="2026-12-03T12:00:00", restarts=0), "earlier job with the same id"),
    (_me(submit="2026-12-03T11:00:00", restarts=1), "submitted later"),
])
def test_a_store_of_another_instance_is_moved_aside_and_never_offered(tmp_path: Path, intruder: JobInstance,
                                                                      why: str) -> None:
    store = _store(tmp_path)
    claim(store, _me())
    _foreign_epoch(store)
    assert why in mismatch(store.read_manifest()["instance"], intruder)
    note = claim(store, intruder)
    assert note and why in note and "moved aside" in note
    assert store.committed() == [] and not store.epoch_dir(1).exists()
    assert store.read_manifest()["instance"]["uid"] == intruder.uid
    stale = list((tmp_path / "c").glob(".stale-43-*"))
    assert len(stale) == 1 and (stale[0] / "epoch-000001" / "batch.0").is_dir()
    assert instance.moved_aside_notes(store) == [note]
    assert claim(store, intruder) is None                               # now it is the intruder's own


def test_an_unbound_store_with_content_is_not_trusted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (store.job_dir / "manifest.json").write_text(json.dumps(
        {"version": 1, "job": 43, "cluster": "c", "epochs": [{"epoch": 1, "ranks": {}}]}))
    assert "no job-instance binding" in claim(store, _me(restarts=1))
    assert store.committed() == []


def test_a_store_copied_in_during_a_run_keeps_the_epoch_being_committed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    claim(store, _me(uid=1002))                # the old job's store, copied over the new job's
    _foreign_epoch(store, 1)
    store.rank_dir(2, "batch", 0).mkdir(parents=True)     # the new job's own images of epoch 2
    store.write_rank_manifest(2, "batch", 0, Capture())
    note = claim(store, _me(restarts=0), keep_epoch=2)
    assert note and "uid 1002" in note
    assert (store.rank_dir(2, "batch", 0) / "rank.json").exists() and not store.epoch_dir(1).exists()
    assert store.commit(2, {"batch.0": {"kind": "image"}}, "interval", 2)["instance"]["uid"] == 1001


def test_pre_capture_checks_see_only_trees_of_the_same_job(tmp_path: Path) -> None:
    for name, pids in (("43.batch.0.0", "10"), ("43.0.1.0", "11 12"), ("77.batch.0.0", "20"), ("x", "30")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text(pids)
    others = TaskCgroup(tmp_path / "43.batch.0.0", TreeName(43, "batch", 0, 0)).other_trees()
    assert set(others) == {11, 12, 20}, "x is no tree's cgroup"
    assert {pid: str(t) for pid, t in ipc.job_trees(others, 43).items()} == {11: "43.0.1.0", 12: "43.0.1.0"}


def _agent(tmp_path: Path, me: JobInstance | None, gpus: dict | None = None):
    from types import SimpleNamespace

    from test_agent_logic import FakePeer, assemble
    from slurmckpt.identity import TaskIdentity
    from slurmckpt.store.fresh_start import FailureReporter
    from slurmckpt.slurm.jobrecord import JobRecord
    store = _store(tmp_path)
    peer = FakePeer()
    peer.pid = 0
    return assemble(TaskIdentity("c", 43, "batch", 0, 1001, 1001, me.restart_count if me else 1), store,
                    peer=peer, cgroup=SimpleNamespace(path=tmp_path / "cg"),
                    runner=SimpleNamespace(root_pid=None, killed_for=""), instance=me,
                    store_note=claim(store, me) if me else None,
                    slurm_job=JobRecord(43, 1001, 1001, "t", 0, "RUNNING", gpus or {}),
                    reporter=FailureReporter(store, 43, "batch.0", "node1", annotate=lambda job, text: "AdminComment",
                                             background=False))


def _commit_foreign(a, uid: int) -> None:
    manifest = a.facts.store.read_manifest()
    manifest["instance"]["uid"] = uid
    (a.facts.store.job_dir / "manifest.json").write_text(json.dumps(manifest))
    _foreign_epoch(a.facts.store)


def test_plan_offers_nothing_to_a_job_that_was_never_requeued(tmp_path: Path) -> None:
    a = _agent(tmp_path, _me(restarts=0))
    _foreign_epoch(a.facts.store)                 # even images bound to this very instance
    assert a.plan.plan({}, [])["candidates"] == []
    from slurmckpt.errors import StorageError
    with pytest.raises(StorageError):
        a.tree.restore({"epoch": 1}, [0, 1, 2])


def test_plan_and_restore_refuse_images_bound_to_another_uid(tmp_path: Path) -> None:
    from slurmckpt.errors import StorageError
    a = _agent(tmp_path, _me(restarts=1))
    _commit_foreign(a, 1002)
    plan = a.plan.plan({}, [])
    assert plan["candidates"] == [] and "uid 1002" in plan["warning"]
    with pytest.raises(StorageError, match="uid 1002"):
        a.tree.restore({"epoch": 1}, [0, 1, 2])
    b = _agent(tmp_path / "b", _me(restarts=1))
    _foreign_epoch(b.facts.store)
    assert [c["epoch"] for c in b.plan.plan({}, [])["candidates"]] == [1]


def test_plan_refuses_when_slurm_did_not_say_who_the_job_is(tmp_path: Path) -> None:
    a = _agent(tmp_path, None)
    assert "could not learn" in a.plan.plan({}, [])["warning"]


def test_restore_gpus_come_from_slurm_not_from_the_wrapper(tmp_path: Path, monkeypatch) -> None:
    import socket

    from slurmckpt.node import procfs
    a = _agent(tmp_path, _me(restarts=1), gpus={socket.gethostname(): [0, 2]})
    for claimed, used in (("1", "0,2"), ("", "0,2"), ("2", "2"), ("2,0", "2,0"), ("0,0", "0,2"),
                          ("GPU-abc", "0,2"), ("3,0", "0,2")):
        monkeypatch.setattr(procfs, "environ", lambda pid, v=claimed: {"CUDA_VISIBLE_DEVICES": v})
        assert a.tree._allocated_gpus() == (used, "PCI_BUS_ID"), claimed
    a.facts.slurm_job = None
    assert a.tree._allocated_gpus() == ("", "PCI_BUS_ID")        # no allocation known: no GPU to restore onto


def test_a_tree_gets_its_own_mount_namespace_by_slurms_gpus_never_by_its_environment(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """The launch request's environment is the wrapper's (the user's): CUDA_VISIBLE_DEVICES there chose the
    mount-namespace mode once. Now Slurm's allocation on this node does."""
    import socket
    from types import SimpleNamespace

    from slurmckpt.agent import tree as agent_mod
    modes: list[bool] = []
    monkeypatch.setattr(agent_mod, "spawn_tree", lambda *args, **kw: modes.append(args[-1]) or 4242)
    monkeypatch.setattr(agent_mod, "init_home", lambda *args: "/nonexistent")
    here = socket.gethostname()
    assert task_defaults.uses_gpus({"CUDA_VISIBLE_DEVICES": "0"}), "the old rule would have given it one"
    for n, (gpus, env, own) in enumerate([({here: []}, {"CUDA_VISIBLE_DEVICES": "0"}, False),
                                          (None, {"CUDA_VISIBLE_DEVICES": "0"}, False),
                                          ({here: [1]}, {}, True), ({here: [0]}, {"CUDA_VISIBLE_DEVICES": ""}, True)]):
        a = _agent(tmp_path / str(n), _me(), gpus=gpus)
        if gpus is None:
            a.facts.slurm_job = None                      # Slurm could not be asked: no GPU is assumed
        a.facts.config = SimpleNamespace(init_path="/x", run_dir=str(tmp_path), cuda_checkpoint_launch="",
                                   block_io_uring=True)
        a.tree._task_credentials = lambda: None
        a.tree._place_with_slurm = lambda: None
        a.tree._context = lambda creds, pid: pid              # the tree's context: not what this test is about
        a.tree.runner = SimpleNamespace(root_pid=None, started=lambda ctx: None)
        assert a.tree.launch({"argv": ["sleep"], "env": env, "cwd": "/"}, [0, 1, 2]) == {"pid": 4242}
        assert modes[-1] is own, (gpus, env)


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.77.0.0
        /24 link UNICAST
     |-- 10.77.0.2
        /32 host LOCAL
     |-- 10.77.0.255
        /32 link BROADCAST
     |-- 127.0.0.1
        /32 host LOCAL
"""


def test_the_node_is_found_by_name_or_by_its_address_never_from_the_environment(tmp_path: Path,
                                                                               monkeypatch) -> None:
    from slurmckpt.slurm import control
    assert proctree.local_addresses(FIB_TRIE) == {"10.77.0.2", "127.0.0.1"}
    assert control.this_node(["node1", "node2"], "node2.cluster") == "node2"
    monkeypatch.setattr(control.CliSlurm, "_run", lambda self, *cmd: (
        "NodeName=node1 Arch=x86_64 NodeAddr=10.77.0.1 NodeHostName=vm Version=22.05.8\n"
        "NodeName=node2 Arch=x86_64 NodeAddr=10.77.0.2 NodeHostName=vm Version=22.05.8\n"))
    assert control.this_node(["node1", "node2"], "vm", local={"10.77.0.2", "127.0.0.1"}) == "node2"
    assert control.this_node([], "vm") is None
