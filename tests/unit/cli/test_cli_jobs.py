"""The CLI names exactly the job the user wrote (array tasks by their own id), signals only the caller's own
jobs, moves a job with `migrate` through Slurm's own steps, and prints what users wrote escaped."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fake_slurm import FakeSlurm, Ran, squeue_answer, squeue_line
from slurmckpt.cli import cli, jobs, lookup
from slurmckpt.cli.output import shown
from slurmckpt.config import Config
from slurmckpt.slurm.jobref import BadJobSpec, JobRef, parse_job_spec
from slurmckpt.store.record import Capture, Files, OutputSnapshot, Tree, WrittenFile

ARRAY_TASK = squeue_line(1240, array=(1234, 5))
OTHER_TASK = squeue_line(1239, array=(1234, 4))


@pytest.mark.parametrize("text,ref", [("7", JobRef(7)), ("1234", JobRef(1234)), ("1234_5", JobRef(1234, 5)),
                                      ("1234_0", JobRef(1234, 0))])
def test_job_specs_accepted(text, ref):
    assert parse_job_spec(text) == ref


@pytest.mark.parametrize("text", ["1234_5_6", "1_2_3", "12a34", " 12", "12 ", "-1", "0", "012", "1234_", "_5",
                                  "1234_05", "1e3", "0x10", "12.5", "１２", "99999999999", "1234+5", "1234_[1-3]",
                                  "", "1_000", "1234\n"])
def test_everything_else_is_refused(text):
    with pytest.raises(BadJobSpec):
        parse_job_spec(text)


def test_the_old_int_parse_named_another_job():
    assert int("1234_5") == 12345            # what click's type=int did with an array task id


@pytest.fixture
def user(monkeypatch, tmp_path: Path):
    """Run the CLI as uid 1001 with a config of our own (no summary there: the submit line decides)."""
    (tmp_path / "slurmckpt.yaml").write_text(f"summary_dir: {tmp_path}/summaries\n")
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    lookup.cluster.cache_clear()

    def be(uid: int) -> None:
        monkeypatch.setattr(os, "geteuid", lambda: uid)
        monkeypatch.setattr(os, "getuid", lambda: uid)
    be(1001)
    return be


def _slurm(monkeypatch, *lines: str, **more) -> FakeSlurm:
    return FakeSlurm(squeue=squeue_answer(*lines), sacct="1240|sbatch --checkpoint-interval=10m x\n",
                     **more).install(monkeypatch)


def test_an_array_task_is_signalled_by_its_own_job_id(user, monkeypatch):
    slurm = _slurm(monkeypatch, ARRAY_TASK, OTHER_TASK)
    r = CliRunner().invoke(cli, ["checkpoint", "1234_5"])
    assert r.exit_code == 0, r.output
    assert slurm.ran("squeue")[0][-2:] == ["-j", "1234_5"]
    assert slurm.ran("scancel")[0][-1] == "1240"


def test_another_users_job_is_refused_before_any_signal(user, monkeypatch):
    user(1002)
    slurm = _slurm(monkeypatch, ARRAY_TASK)
    for args in (["checkpoint", "1234_5"], ["checkpoint", "--force", "1234_5"], ["requeue", "1240"],
                 ["migrate", "1240", "--to", "node2"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and "refused: job 1240 (1234_5) belongs to uid 1001" in r.output, r.output
    assert not slurm.ran("scancel") and not any(c[:2] == ["scontrol", "update"] for c in slurm.calls)


def test_root_may_checkpoint_any_users_job(user, monkeypatch):
    user(0)
    slurm = _slurm(monkeypatch, squeue_line(1240))
    assert CliRunner().invoke(cli, ["checkpoint", "1240"]).exit_code == 0
    assert slurm.ran("scancel")


@pytest.mark.parametrize("command", [["checkpoint"], ["inspect"], ["status"], ["requeue"],
                                     ["migrate", "--to", "node2"]])
@pytest.mark.parametrize("bad", ["1234_5_6", "12a34", "1234_", "-5"])
def test_commands_refuse_malformed_job_ids_with_a_clear_error(user, monkeypatch, command, bad):
    slurm = _slurm(monkeypatch)
    r = CliRunner().invoke(cli, [*command, "--", bad])
    assert r.exit_code == 2 and "is not a job id" in r.output, r.output
    assert slurm.calls == []


# ---- migrate ---------------------------------------------------------------------------------------------
def _moving(states: list[str]):
    """squeue answers for a job that goes through `states`, one per question, then stays in the last."""
    seen: list[str] = []

    def answer(cmd: list[str]) -> Ran:
        state = states[min(len(seen), len(states) - 1)]
        seen.append(state)
        nodes = "node2" if state == "RUNNING" and len(seen) > 2 else "node1"
        return Ran(0, squeue_line(1240, state=state, nodes=nodes, restarts=1 if len(seen) > 2 else 0))
    return answer


def _nodes(cmd: list[str]) -> Ran:
    if cmd[1:3] == ["show", "node"]:
        node = cmd[-1]
        state = {"node1": "MIXED", "node2": "IDLE", "node3": "DOWN*", "node4": "IDLE"}.get(node)
        if state is None:
            return Ran(1, "", f"Node {node} not found")
        parts = "debug,low" if node != "node4" else "other"
        return Ran(0, f"NodeName={node} Arch=x86_64 State={state} Partitions={parts}\n")
    return Ran(0, "ClusterName = c\n")


def test_migrate_captures_requeues_points_the_pending_job_at_the_node_and_waits_for_it(user, monkeypatch):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    slurm = FakeSlurm(squeue=_moving(["RUNNING", "RUNNING", "PENDING", "RUNNING"]), scontrol=_nodes,
                      sacct="1240|sbatch --checkpoint-interval=10m x\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["migrate", "1240", "--to", "node2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["action"] == "migrate" and doc["detail"].startswith("running on node2 (restart 1)")
    order = [c[0] if c[0] != "scontrol" else " ".join(c[:2]) for c in slurm.calls]
    signal_at, update_at = order.index("scancel"), order.index("scontrol update")
    assert signal_at < update_at and "squeue" in order[signal_at:update_at]     # pending before the update
    assert ["scontrol", "update", "JobId=1240", "ReqNodeList=node2"] in slurm.calls


def test_migrate_names_the_requeue_delay_when_the_job_ran_again_before_its_node_list_was_set(user, monkeypatch):
    """requeue_delay=0 (Slurm 25.11+) or --requeue=expedite: the requeued job may run again (restart 1) before
    the CLI sees it pending; Slurm refuses ReqNodeList on a running job, and the CLI says why, never waits for
    a PENDING that will not come."""
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)

    def scontrol(cmd: list[str]) -> Ran:
        if cmd[1] == "update":
            return Ran(1, "", "slurm_update error: Job is no longer pending execution")
        return _nodes(cmd)
    FakeSlurm(squeue=_moving(["RUNNING", "RUNNING", "RUNNING"]), scontrol=scontrol,
              sacct="1240|sbatch --checkpoint-interval=10m x\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["migrate", "1240", "--to", "node2"])
    assert r.exit_code == 1 and "refused ReqNodeList=node2" in r.output and "requeue_delay=0" in r.output, r.output


@pytest.mark.parametrize("target, why", [("node3", "is DOWN*"), ("node9", "Slurm knows no such node"),
                                         ("node4", "not in the job's partition debug"),
                                         ("node1", "already runs on node1")])
def test_migrate_refuses_a_target_slurm_would_not_run_it_on_before_anything_is_sent(user, monkeypatch, target,
                                                                                     why):
    slurm = FakeSlurm(squeue=squeue_answer(squeue_line(1240)), scontrol=_nodes).install(monkeypatch)
    r = CliRunner().invoke(cli, ["migrate", "1240", "--to", target])
    assert r.exit_code == 1 and why in r.output, r.output
    assert not slurm.ran("scancel")


def test_migrate_says_when_the_job_ends_instead_of_being_requeued(user, monkeypatch):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    FakeSlurm(squeue=_moving(["RUNNING", "RUNNING", "COMPLETED"]), scontrol=_nodes,
              sacct="1240|sbatch --checkpoint-interval=10m x\n").install(monkeypatch)
    r = CliRunner().invoke(cli, ["migrate", "1240", "--to", "node2"])
    assert r.exit_code == 1 and "ended (COMPLETED) while waiting for the capture and requeue" in r.output


# ---- what users wrote, shown ------------------------------------------------------------------------------
def test_shown_escapes_control_characters_and_terminal_sequences():
    assert shown("/home/u/out.txt") == "/home/u/out.txt"
    assert shown("naïve ünïcode") == "naïve ünïcode"
    for hostile in ("\x1b[2J\x1b[H", "a\nb", "x\rroot# ", "\x1b]0;title\x07", "evil\u202etxt.exe", "\x9b31m"):
        out = shown(hostile)
        assert out.isprintable() and "\x1b" not in out and "\u202e" not in out, out


def test_inspect_prints_user_strings_escaped(monkeypatch, tmp_path: Path):
    from slurmckpt.cli import lookup as lk
    from slurmckpt.store.jobstore import JobStore
    root = tmp_path / "images"
    store = JobStore(root, "c", 77)
    store.ensure()
    rdir = store.rank_dir(1, "batch", 0)
    rdir.mkdir(parents=True)
    store.write_rank_manifest(1, "batch", 0, Capture(
        Tree(node="n1\x1b[2Jx.py", processes=1, uid=1001),
        Files(truncate=(WrittenFile("/tmp/a\nfake line", 1),)),
        outputs=(OutputSnapshot(1, "/home/u/\x1b]0;pwned\x07out", 3, "output-1.snap", None),)))
    store.commit(1, {"batch.0": {"kind": "image", "node": "n1"}}, "interval", 2)
    monkeypatch.setattr(lk, "load_user_config", lambda: Config.from_mapping({"storage_root": str(root)}))
    r = CliRunner().invoke(cli, ["inspect", "77"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output and "fake line\n" not in r.output
    assert "\\x1b[2Jx.py" in r.output and "\\x1b]0;pwned\\x07out" in r.output
    r = CliRunner().invoke(cli, ["inspect", "--json", "77"])
    assert json.loads(r.output)["ranks"]["batch.0"]["node"] == "n1\x1b[2Jx.py"   # JSON escapes itself


def test_inspect_shows_timings_and_sizes_as_people_read_them_and_json_keeps_the_numbers(monkeypatch, tmp_path: Path):
    from slurmckpt.cli import lookup as lk
    from slurmckpt.store.jobstore import JobStore
    root = tmp_path / "images"
    store = JobStore(root, "c", 78)
    store.ensure()
    store.rank_dir(1, "batch", 0).mkdir(parents=True)
    with open(store.rank_dir(1, "batch", 0) / "pages-1.img", "wb") as f:
        f.truncate(3 << 20)                 # sparse: the store's size, not its bytes, is what is shown
    timings = {"criu_dump": 0.06415949600000204, "dump": 125.5, "expected_mib": 1536.0, "freeze_wait": 0.0031,
               "persist": 12.345}
    store.seal_rank(1, "batch", 0, {"pages-1.img": {"size": 3 << 20, "raw_size": 5 << 30}},
                    Capture(Tree(node="n1", processes=2, uid=1001), timings=timings))
    store.commit(1, {"batch.0": {"kind": "image", "node": "n1"}}, "interval", 2)
    monkeypatch.setattr(lk, "load_user_config", lambda: Config.from_mapping({"storage_root": str(root)}))
    r = CliRunner().invoke(cli, ["inspect", "78"])
    assert r.exit_code == 0, r.output
    assert "3.0 MiB stored (5.0 GiB raw) in 1 file(s)" in r.output, r.output
    assert ("timings: criu_dump 0.06 s, dump 2m6s, freeze_wait 0.00 s, persist 12.3 s, expected 1.5 GiB\n"
            in r.output), r.output
    assert "0.0641594" not in r.output
    r = CliRunner().invoke(cli, ["inspect", "--json", "78"])
    assert json.loads(r.output)["ranks"]["batch.0"]["timings"] == timings
