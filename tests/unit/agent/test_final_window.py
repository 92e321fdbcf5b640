"""The time Slurm gives a final capture: read from Slurm (slurm/window.py, control.py), the capture's cost from
the rank's own measured captures or the budget's rates (coordinator/budget.py), and the decision before
anything is frozen (agent/window.py), with a fake clock, a fake Slurm and a real store."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_slurm import FakeSlurm
from slurmckpt.agent.window import FinalWindow, check_final, measured, restores_instead, trigger_age
from slurmckpt.coordinator.budget import (FINAL_MARGIN, FINAL_TAIL_S, MeasuredCapture, RankSize, final_capture_cost,
                                          judge_final)
from slurmckpt.cuda.interface import GpuUse
from slurmckpt.errors import SlurmError, WindowTooShort
from slurmckpt.rank.fit import Footprint
from slurmckpt.slurm import jobrecord, window
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.slurm.window import KillWindow
from slurmckpt.store.jobstore import JobStore
from fake_runner import fake_runner
from slurmckpt.store.record import Capture, Tree

GIB = 2**30
CONFIG = "ClusterName             = ckpt\nKillWait                = 30 sec\nPreemptType             = {type}\n"


# ---- the window, from Slurm ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("30 sec", 30), ("5", 5), ("00:01:30", 90), ("1-00:00:00", 86400),
                                           ("2:05", 125), ("N/A", 0), ("", 0)])
def test_slurm_spells_seconds_several_ways(text, seconds):
    assert window.seconds_field(text, "KillWait") == seconds


@pytest.mark.parametrize("text", ["thirty", "30 min", "-5", "99999999999"])
def test_a_value_that_is_no_number_of_seconds_is_an_error(text):
    with pytest.raises(ValueError, match="KillWait"):
        window.seconds_field(text, "KillWait")


def test_preempt_partition_prio_reads_the_partitions_grace_time(monkeypatch):
    slurm = FakeSlurm(scontrol=lambda cmd: CONFIG.format(type="preempt/partition_prio") if "config" in cmd else
                      "PartitionName=low AllowGroups=ALL Default=NO GraceTime=45 Hidden=NO PreemptMode=REQUEUE\n")
    slurm.install(monkeypatch)
    values = CliSlurm().config_values()
    got = CliSlurm().kill_window("low", "normal", values)
    assert got == KillWindow(30, 45, "partition low")
    assert slurm.calls[-1] == ["scontrol", "show", "partition", "-o", "low"] and not slurm.ran("sacctmgr")
    assert got.seconds(False) == 30 and got.seconds(True) == 75
    assert got.describe(False) == "30 s (KillWait)"
    assert got.describe(True) == "75 s (GraceTime 45 s of partition low + KillWait 30 s)"
    assert CliSlurm().cluster_name(values) == "ckpt"


def test_preempt_qos_reads_the_qos_grace_time_and_none_reads_nothing(monkeypatch):
    slurm = FakeSlurm(scontrol=CONFIG.format(type="preempt/qos"), sacctmgr="normal|00:02:00\nhigh|00:00:00\n")
    slurm.install(monkeypatch)
    assert CliSlurm().kill_window("low", "normal") == KillWindow(30, 120, "QOS normal")
    assert slurm.ran("sacctmgr") == [["sacctmgr", "-n", "-P", "show", "qos", "normal", "format=Name,GraceTime"]]
    slurm = FakeSlurm(scontrol=CONFIG.format(type="preempt/none")).install(monkeypatch)
    assert CliSlurm().kill_window("low", "normal") == KillWindow(30, 0, "")
    assert len(slurm.calls) == 1


def test_a_garbled_answer_is_a_slurm_error(monkeypatch):
    FakeSlurm(scontrol="KillWait = soon\n").install(monkeypatch)
    with pytest.raises(SlurmError, match="KillWait"):
        CliSlurm().kill_window("debug", "normal")


@pytest.mark.parametrize("entry, preempted", [
    ({"preempt_time": 0, "start_time": 100}, False),
    ({"preempt_time": 150, "start_time": 100}, True),
    ({"preempt_time": 50, "start_time": 100}, False),          # an earlier run's preemption
    ({"preempt_time": {"set": True, "infinite": False, "number": 150}, "start_time": {"set": True, "number": 100}}, True),
    ({"preempt_time": {"set": False, "number": 0}}, False),
    ({"preempt_time": "150"}, False)])
def test_preempted_reads_both_json_shapes(entry, preempted):
    assert jobrecord.preempted(entry) is preempted


# ---- the cost of a final capture ------------------------------------------------------------------------
def test_a_measured_capture_is_scaled_to_todays_bytes():
    then = MeasuredCapture(3, 8 * GIB, byte_s=12.0, fixed_s=1.0)
    cost = final_capture_cost(RankSize("batch.0", "n", 12 * GIB, 4 * GIB, 1), then)
    assert cost.seconds == round((1.0 + 12.0 * 2) * FINAL_MARGIN + FINAL_TAIL_S, 1)
    assert cost.basis == "measured at epoch 3: 8.0 GiB into staging in 13.0 s; 16.0 GiB now"


def test_without_a_measured_capture_the_budgets_rates_decide():
    cost = final_capture_cost(RankSize("batch.0", "n", 2 * GIB, 16 * GIB, 1), None)
    # GPU copy 16 GiB at 2 GB/s + one call, dump 18 GiB at 1 GB/s (coordinator/budget.py)
    assert cost.seconds == round((0.5 + 16 * GIB / 2e9 + 18 * GIB / 1e9) * FINAL_MARGIN + FINAL_TAIL_S, 1)
    assert cost.basis.startswith("no capture of it measured yet: 18.0 GiB at 1.0 GB/s dump, 2.0 GB/s GPU copy")


def test_a_tiny_measured_capture_keeps_its_seconds_and_rates_the_growth():
    then = MeasuredCapture(1, 1 << 20, byte_s=0.3, fixed_s=0.2)
    cost = final_capture_cost(RankSize("batch.0", "n", 2 * GIB + (1 << 20)), then)
    assert cost.seconds == round((0.5 + 2 * GIB / 1e9) * FINAL_MARGIN + FINAL_TAIL_S, 1)


def test_the_measured_stall_of_the_16_gib_gpu_job_does_not_fit_killwait_30():
    """The GPU machine: 16 GiB of device memory, 29 s per periodic capture into staging. KillWait=30 cannot
    hold its final capture: decided before anything is frozen, and said."""
    then = MeasuredCapture(2, 17 * GIB, byte_s=27.5, fixed_s=1.5)
    cost = final_capture_cost(RankSize("batch.0", "n", 1 * GIB, 16 * GIB, 1), then)
    verdict = judge_final(cost, 30, "30 s (KillWait)", 0.4)
    assert not verdict.fits
    assert verdict.text == (f"final capture needs ~{cost.seconds:.0f} s (measured at epoch 2: 17.0 GiB into staging in "
                            "29.0 s; 17.0 GiB now), Slurm allows 30 s (KillWait) and 0.4 s of it have passed since "
                            "the SIGTERM")
    eight = final_capture_cost(RankSize("batch.0", "n", 1 * GIB, 8 * GIB, 1), MeasuredCapture(2, 9 * GIB, 13.5, 1.0))
    assert judge_final(eight, 30, "30 s (KillWait)", 0.4).fits


def test_the_final_path_counts_every_stage_of_prepare_and_capture_and_the_host_copy_follows_the_bytes():
    """What a final capture must finish before Slurm's SIGKILL is PREPARE and PERIODIC_CAPTURE as the periodic
    captures ran them (their timings are the measurement): a stage added to a table and left out here makes
    the window judged too short for it (host-copy once was: a 17.5 GiB capture judged ~10 s took 19-20 s)."""
    from slurmckpt.coordinator.budget import BYTE_STAGES, FINAL_STAGES
    from slurmckpt.rank.capture import PERIODIC_CAPTURE, PREPARE
    assert FINAL_STAGES == PREPARE.names + PERIODIC_CAPTURE.names
    assert set(BYTE_STAGES) == {"gpu-checkpoint", "host-copy", "dump"} <= set(FINAL_STAGES)
    timings = {"gpu-checkpoint": 4.0, "host-copy": 8.0, "dump": 0.5, "check": 0.2, "freeze": 0.1}
    then = MeasuredCapture.from_timings(2, 17 * GIB, timings)
    assert then is not None and (then.byte_s, then.fixed_s) == (12.5, pytest.approx(0.3))


def test_time_already_gone_counts_against_the_window():
    cost = final_capture_cost(RankSize("batch.0", "n", GIB), MeasuredCapture(1, GIB, 1.0, 0.5))
    assert judge_final(cost, 5, "5 s (KillWait)", 0.0).fits
    assert not judge_final(cost, 5, "5 s (KillWait)", 5 - cost.seconds + 0.1).fits


# ---- the agent's decision -------------------------------------------------------------------------------
def footprint(host: int, gpu: int = 0) -> Footprint:
    use = GpuUse(held={4242: {"GPU-0": gpu}}) if gpu else GpuUse()
    return Footprint(host, use, 64 * GIB, None, None)


def committed_store(tmp_path: Path, timings: dict | None, raw: int, at: float = 1000.0) -> JobStore:
    """A store whose epoch 2 holds batch.0 captured at `at`, with these stage timings and raw bytes."""
    store = JobStore(tmp_path, "c", 9)
    rdir = store.rank_dir(2, "batch", 0)
    rdir.mkdir(parents=True)
    (rdir / "pages-1.img").write_bytes(b"x")
    store.write_rank_manifest(2, "batch", 0, Capture(Tree(captured_at=at), timings=timings or {}))
    manifest = json.loads((rdir / "rank.json").read_text())
    manifest["files"]["pages-1.img"]["raw_size"] = raw
    (rdir / "rank.json").write_text(json.dumps(manifest))
    store.commit(2, {"batch.0": {"kind": "image"}}, "interval", 2)
    return store


TIMINGS = {"check": 0.1, "space": 0.2, "freeze": 0.05, "record": 0.1, "dump": 2.0, "snapshot-output": 0.05,
           "persist": 30.0, "criu_dump": 1.9}


def test_the_rank_json_of_the_newest_commit_is_the_measurement(tmp_path):
    store = committed_store(tmp_path, TIMINGS, 2 * GIB)
    m = measured(store, "batch", 0)
    assert m == MeasuredCapture(2, 2 * GIB, byte_s=2.0, fixed_s=pytest.approx(0.5))     # persist is not on the path
    assert measured(committed_store(tmp_path / "old", None, GIB), "batch", 0) is None      # no timings kept
    assert measured(JobStore(tmp_path / "none", "c", 9), "batch", 0) is None


def fw(kill_wait: int = 30, grace: int = 0, preempted: object = False, now: float = 1100.0) -> FinalWindow:
    def ask(job: int) -> bool:
        if isinstance(preempted, Exception):
            raise preempted
        return bool(preempted)
    return FinalWindow(KillWindow(kill_wait, grace, "partition low" if grace else ""), 9, ask, clock=lambda: now)


def runner(fp: Footprint | None) -> SimpleNamespace:
    return fake_runner(footprint=fp)


def sigterm(**kw) -> dict:
    return {"epoch": 3, "final": True, "trigger": "sigterm", **kw}


def test_a_final_capture_that_fits_goes_on(tmp_path):
    store = committed_store(tmp_path, TIMINGS, 2 * GIB)
    r = runner(footprint(2 * GIB))
    check_final(fw(kill_wait=5), store, "batch", 0, r, sigterm(trigger_age_s=0.3))
    assert r.failed_stage == ""


def test_one_that_does_not_fit_is_refused_before_freezing_and_says_what_it_costs(tmp_path):
    store = committed_store(tmp_path, TIMINGS, 2 * GIB, at=1000.0)
    r = runner(footprint(2 * GIB))
    with pytest.raises(WindowTooShort) as refused:
        check_final(fw(kill_wait=5, now=1064.0), store, "batch", 0, r, sigterm(trigger_age_s=2.5))
    assert r.failed_stage == "window"
    assert str(refused.value) == (
        "final capture skipped: final capture needs ~4 s (measured at epoch 2: 2.0 GiB into staging in 2.5 s; "
        "2.0 GiB now), Slurm allows 5 s (KillWait) and 2.5 s of it have passed since the SIGTERM; the job "
        "restores epoch 2, taken 64 s before this requeue")


def test_with_nothing_measured_the_rates_decide_and_nothing_committed_is_said(tmp_path):
    store = JobStore(tmp_path, "c", 9)
    with pytest.raises(WindowTooShort, match=r"needs ~\d+ s \(no capture of it measured yet: 24.0 GiB at 1.0 GB/s "
                                             r"dump, 2.0 GB/s GPU copy\), Slurm allows 30 s \(KillWait\); no "
                                             "checkpoint was committed yet: the job starts from the beginning"):
        check_final(fw(), store, "batch", 0, runner(footprint(4 * GIB, 20 * GIB)), sigterm())
    check_final(fw(), store, "batch", 0, runner(footprint(GIB)), sigterm())


def test_a_preemption_adds_the_grace_time_and_a_silent_slurmctld_leaves_killwait(tmp_path):
    store = committed_store(tmp_path, TIMINGS, 2 * GIB)
    big = runner(footprint(40 * GIB))                # ~55 s at the measured rate
    with pytest.raises(WindowTooShort, match=r"Slurm allows 30 s \(KillWait\)"):
        check_final(fw(grace=60, preempted=False), store, "batch", 0, big, sigterm())
    check_final(fw(grace=60, preempted=True), store, "batch", 0, big, sigterm())
    with pytest.raises(WindowTooShort, match=r"Slurm allows 30 s \(KillWait\)"):
        check_final(fw(grace=60, preempted=SlurmError("slurmctld down")), store, "batch", 0, big, sigterm())


def test_only_a_final_capture_after_slurms_sigterm_is_judged(tmp_path):
    store = JobStore(tmp_path, "c", 9)
    huge = runner(footprint(500 * GIB))
    for message in (sigterm(final=False), sigterm(trigger="walltime"), sigterm(trigger="manual-requeue")):
        check_final(fw(), store, "batch", 0, huge, message)
    check_final(None, store, "batch", 0, huge, sigterm())
    check_final(fw(), store, "batch", 0, runner(None), sigterm())


@pytest.mark.parametrize("message, age", [({"trigger_age_s": 2.5}, 2.5), ({}, 0.0), ({"trigger_age_s": -3}, 0.0),
                                          ({"trigger_age_s": "7"}, 0.0), ({"trigger_age_s": 1e12}, 86400.0)])
def test_the_trigger_age_is_bounded(message, age):
    assert trigger_age(message) == age


def test_what_a_requeue_restores_instead(tmp_path):
    assert restores_instead(committed_store(tmp_path, TIMINGS, GIB, at=500.0), 800.0) == \
        "the job restores epoch 2, taken 300 s before this requeue"


# ---- what `slurmckpt doctor` tells the admin ------------------------------------------------------------
def test_doctor_says_what_killwait_and_each_grace_time_hold_at_the_measured_rate(tmp_path, monkeypatch):
    from slurmckpt.cli.doctor import Report, check_kill_window
    from slurmckpt.config import Config
    FakeSlurm(scontrol=lambda cmd: (
        "ClusterName = c\nKillWait = 30 sec\nPreemptType = preempt/partition_prio\n" if "config" in cmd else
        "PartitionName=debug Default=YES GraceTime=0\nPartitionName=low Default=NO GraceTime=90 Hidden=NO\n")
    ).install(monkeypatch)
    committed_store(tmp_path, {"dump": 2.0, "gpu-checkpoint": 2.0, "freeze": 0.5}, 8 * GIB)    # 2 GiB/s, 0.5 s
    r = Report()
    check_kill_window(r, Config.from_mapping({"storage_root": str(tmp_path)}))
    head, low = r.rows
    # (30 - 1) / 1.15 - 0.5 = 24.7 s at 2 GiB/s: 49 GiB; an 8 GiB rank needs (0.5 + 4) * 1.15 + 1 = 6 s
    assert head["result"] == "ok" and head["check"] == "final capture window"
    assert head["detail"].startswith("KillWait 30 s (requeue, scancel, time limit) holds the final capture of ~49 GiB "
                                     "per rank at the rate of 1 capture(s) in this cluster's store (8.0 GiB into "
                                     "staging in 4.5 s); a GPU rank's final capture needs 8 GiB: 6 s, 16 GiB: 11 s, "
                                     "32 GiB: 20 s, 80 GiB: 48 s"), head["detail"]
    assert low == {"result": "ok", "check": "final capture window, partition low",
                   "detail": "preemption: GraceTime 90 s + KillWait 30 s holds ~206 GiB per rank"}


def test_slurmd_gives_at_least_five_seconds_whatever_killwait_says():
    """slurmd's terminate waits MAX(KillWait, 5) before its SIGKILL."""
    assert KillWindow(2).seconds(False) == 5 and KillWindow(2).describe(False) == \
        "5 s (KillWait 2 s, and slurmd waits at least 5 s)"
    assert KillWindow(2, 30, "QOS x").describe(True) == \
        "35 s (GraceTime 30 s of QOS x + KillWait 2 s, and slurmd waits at least 5 s)"


# ---- through the agent's loop (fakes of tests/unit/agent/test_agent_logic.py) --------------------------------------
def test_the_agent_refuses_a_final_capture_that_cannot_fit_in_size_and_records_it(tmp_path):
    """The agent's SIZE of a final epoch after Slurm's SIGTERM: the refusal is replied with stage `window`
    (the coordinator aborts before anyone freezes), recorded as the final capture's failure (the AdminComment,
    slurmd's log), and a size that fits is replied normally."""
    from test_agent_logic import FakeChannel, request, sizing_agent
    from slurmckpt.store.fresh_start import failures

    def size(epoch):
        a.tree.runner.footprint = footprint(40 * GIB)
        return {"host_bytes": 40 * GIB, "notes": []}
    chan = FakeChannel(request("size", epoch=3, final=True, trigger="sigterm", trigger_age_s=1.0),
                       request("size", epoch=4, final=True, trigger="walltime"))
    a, _ = sizing_agent(tmp_path, chan, size)
    a.epochs.final_window = fw(kill_wait=30)
    a.serve()
    refused, fitted = chan.sent
    assert refused["ok"] is False and refused["stage"] == "window" and refused["error_type"] == "WindowTooShort"
    assert "final capture skipped: final capture needs ~" in refused["error"]
    (failure,) = failures(a.facts.store)
    assert (failure.epoch, failure.stage, failure.final, failure.trigger) == (3, "window", True, "sigterm")
    assert failure.describe().startswith("the final capture at epoch 3 was not taken on rank 0.0: final capture "
                                         "skipped: final capture needs ~")
    assert fitted["ok"] is True, "a wall-time final capture has no Slurm window to fit"


def test_the_hosting_agent_records_a_final_epoch_begun_and_hands_it_over_instead_of_committing(tmp_path):
    from test_agent_logic import FakeChannel, make_agent, request
    from slurmckpt.config import Config
    from slurmckpt.store import handover
    a = make_agent(tmp_path, FakeChannel(request("allocate_epoch", at_least=1, final=True)))
    a.facts.config = Config.from_mapping({})
    a.serve()
    epoch = a.channel.sent[0]["epoch"]
    assert handover.begun(a.facts.store)["epoch"] == epoch
    ranks = {"0.0": {"kind": "image", "node": "n1"}}
    assert a.job.commit({"epoch": epoch, "ranks": ranks, "reason": "sigterm", "final": True}, []) == \
        {"committed": False}
    assert a.facts.store.committed() == [] and handover.pending(a.facts.store.read_manifest())[0]["ranks"] == ranks
