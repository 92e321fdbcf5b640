"""--checkpoint-interval=auto: the grammar (same as the shim's), Young's and Daly's formulas at their limits,
the choice the coordinator makes from measured stalls and the partition's interruptions (smoothed, bounded,
re-chosen), the agent's plan and answers, the record users see in `slurmckpt status`, and the coordinator
process announcing its choices. How the agent reads accounting: test_interruptions.py."""
from __future__ import annotations

import dataclasses
import json
import math
import queue
import time
from pathlib import Path

import pytest

from fake_slurm import FakeSlurm
from slurmckpt.store import summary
from slurmckpt.config import Config
from slurmckpt.coordinator.interval import AutoInterval, AutoSettings, daly, young
from slurmckpt.duration import AUTO, format_interval, interval_arg, parse_duration, parse_interval
from slurmckpt.slurm.env import TaskEnv
from slurmckpt.store.jobstore import JobStore


# ---- the value ---------------------------------------------------------------------------------------------
def test_auto_is_an_interval_value_in_any_case_and_nothing_else_is():
    assert parse_interval("auto") == parse_interval("Auto") == AUTO
    assert parse_interval("30m") == 1800 and format_interval(AUTO) == "auto" and format_interval(90) == "1m30s"
    with pytest.raises(ValueError, match="invalid --checkpoint-interval value 'autoo': expected off, auto, 0"):
        parse_interval("autoo")
    with pytest.raises(ValueError, match="expected off, 0,"):        # durations (min_interval...) have no auto
        parse_duration("auto")
    assert interval_arg("auto") == AUTO and interval_arg("600") == 600          # the shim's argv and environment
    env = TaskEnv.from_environ({"SLURM_JOB_ID": "5", "SLURMCKPT_INTERVAL": "auto"})
    assert env.interval_s == AUTO


def test_auto_turns_checkpointing_on_for_the_cli():
    from slurmckpt.cli.lookup import interval_on
    assert interval_on("auto") and interval_on("AUTO") and not interval_on("off") and not interval_on("autox")


# ---- the formulas ------------------------------------------------------------------------------------------
def test_young_and_daly_at_known_points_and_their_limits():
    assert young(2.0, 3600) == pytest.approx(120.0)
    # Daly: sqrt(2CM) (1 + sqrt(C/2M)/3 + C/18M) - C
    c, m = 2.0, 3600.0
    assert daly(c, m) == pytest.approx(120 * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c)
    assert daly(c, m) == pytest.approx(118.67, abs=0.01)
    assert daly(1e-6, 86400) == pytest.approx(young(1e-6, 86400), rel=1e-3)   # small C: Daly -> Young
    assert daly(100.0, 50.0) == 50.0 and daly(100.0, 49.0) == 49.0           # C >= 2M: T = M
    assert daly(99.99, 50.0) == pytest.approx(50 * (2 * (1 + 1 / 3 + 2 / 18) - 2), rel=1e-3)   # 8/9 M below
    for c in (0.1, 1, 10, 60):                                                # grows with C and with M
        assert daly(c, 3600) < daly(c * 2, 3600) and daly(c, 3600) < daly(c, 7200)


def settings(**kw) -> AutoSettings:
    return AutoSettings(**{"min_s": 10, "max_s": 86400, "first_s": 600, "mtbi_s": 86400.0,
                           "min_from": "the site default", "max_from": "", **kw})


def committed(stall: float, final: bool = False) -> dict:
    return {"status": "committed", "final": final, "stall_s": stall}


def test_no_measurement_means_the_first_interval_within_the_bounds():
    a = AutoInterval(settings())
    assert (a.current.interval_s, a.current.basis, a.current.stall_s, a.current.bound) == (600, "first", None, "")
    assert AutoInterval(settings(first_s=5)).current.interval_s == 10           # never below the minimum
    low = AutoInterval(settings(first_s=5)).current
    assert low.bound == "min_interval" and "min_interval 10s of the site default" in low.describe()
    assert AutoInterval(settings(first_s=7200, max_s=3600)).current.interval_s == 3600
    assert "no capture measured yet" in a.current.describe()


def test_a_committed_periodic_capture_re_chooses_from_the_median_stall():
    a = AutoInterval(settings(mtbi_s=3600.0))
    assert a.observe(committed(2.0))                          # changed: first -> Daly
    assert a.current.basis == "daly" and a.current.interval_s == round(daly(2.0, 3600))
    assert a.current.young_s == pytest.approx(120.0)
    assert not a.observe({"status": "aborted", "stall_s": 50.0})              # not a sample
    assert not a.observe(committed(50.0, final=True))                       # a final capture: not a sample
    a.observe(committed(2.2))
    a.observe(committed(40.0))                                 # one slow capture does not swing it
    assert a.current.stall_s == 2.2 and a.current.stalls == (2.0, 2.2, 40.0)
    for s in (2.1, 2.3, 2.4, 2.5):                             # only the last five count
        a.observe(committed(s))
    assert a.current.stalls == (40.0, 2.1, 2.3, 2.4, 2.5) and a.current.stall_s == 2.4
    assert "Daly: stall 2.40s (median of 5 capture(s)), MTBI 1h" in a.current.describe()


def test_the_interruption_rate_re_chooses_and_bounds_hold():
    a = AutoInterval(settings(stalls=(1.0,), max_s=1800))         # an earlier run's stalls: measured already
    assert a.current.basis == "daly" and a.current.interval_s == round(daly(1.0, 86400))      # 415 s
    assert a.heard({"source": "accounting", "mtbi_s": 600.0, "interruptions": 3, "node_s": 1800.0,
                    "partition": "low", "nodes": 1})
    assert a.current.interval_s == round(daly(1.0, 600)) and a.current.mtbi_s == 600.0
    assert "accounting: 3 interruption(s) in 0.5 node-hours of partition low" in a.current.describe()
    a.heard({"source": "accounting", "mtbi_s": 30 * 86400.0})
    assert (a.current.interval_s, a.current.bound) == (1800, "max_interval")     # Daly ~2277 s above the max
    for bad in ({}, {"mtbi_s": 0}, {"mtbi_s": -5}, {"mtbi_s": float("nan")}, {"mtbi_s": "1d"}):
        assert not a.heard(bad) and a.current.mtbi_s == 30 * 86400.0
    tiny = AutoInterval(settings(stalls=(0.0,), mtbi_s=20.0))                  # C near 0, M tiny: the minimum
    assert (tiny.current.interval_s, tiny.current.bound) == (10, "min_interval")
    huge = AutoInterval(settings(stalls=(500.0,), mtbi_s=100.0))               # C >= 2M: T = M, bounded
    assert huge.current.daly_s == 100.0 and huge.current.interval_s == 100


# ---- what the store keeps and users read -------------------------------------------------------------------
def test_the_interval_record_keeps_typed_bounded_fields_only(tmp_path: Path):
    a = AutoInterval(settings(stalls=(1.5,)))
    a.heard({"source": "accounting", "mtbi_s": 7200.0, "interruptions": 2, "node_s": 7200.0, "runs": 9,
             "partition": "low", "nodes": 1, "prior_s": 86400, "window_s": 604800})
    store = JobStore(tmp_path / "images", "c", 9)
    store.ensure()
    summary.record_interval(store, a.current.as_dict())
    rec = summary.build(store)["interval"]
    assert rec["interval_s"] == a.current.interval_s and rec["stalls"] == [1.5] and rec["basis"] == "daly"
    assert rec["interruptions"]["source"] == "accounting" and summary.recorded_stalls(store) == [1.5]
    hostile = {"interval_s": "10", "stall_s": float("inf"), "basis": "x" * 5000, "stalls": [1, "2", -3, True] * 10,
               "interruptions": {"k": {"nested": 1}, "n": float("nan"), "s": "y" * 900}, "extra": 1}
    clean = summary.interval_record(hostile)
    assert set(clean) == {"basis", "stalls", "interruptions"} and len(clean["basis"]) == 200
    assert clean["stalls"] == [1] * 4 and clean["interruptions"] == {"s": "y" * 500}
    assert summary.interval_record("nonsense") == {}
    read = summary.checked(json.loads(json.dumps(summary.build(store))), "c", 9)
    assert read["interval"] == rec


def test_status_shows_the_interval_and_its_inputs():
    from slurmckpt.cli.status import interval_lines
    a = AutoInterval(settings(stalls=(0.4, 0.5), min_s=60, min_from="partition low"))
    a.heard({"source": "accounting", "mtbi_s": 900.0, "node_mtbi_s": 1800.0, "interruptions": 4, "node_s": 7200.0,
             "runs": 12, "partition": "low", "nodes": 2, "prior_s": 86400, "window_s": 604800})
    lines = interval_lines(summary.interval_record(a.current.as_dict()))
    assert lines[0].startswith("   Interval: auto 1m chosen ") and "for a stall of 0.45s (median of 0.40 0.50)" in lines[0]
    assert "bounds 1m..1d, set by min_interval of partition low" in lines[0]
    assert lines[1] == ("   MTBI: 0.25h for the job (accounting: 4 interruption(s) in 2.0 node-hours of 12 run(s) of "
                        "partition low over 7d, weighed with interruption_mtbi 1d; per node, 2 nodes)")
    first = interval_lines(summary.interval_record(AutoInterval(settings()).current.as_dict()))
    assert "auto 10m chosen" in first[0] and "auto_first_interval: no capture measured yet" in first[0]
    assert interval_lines({}) == []


# ---- in the agent ------------------------------------------------------------------------------------------
def test_the_agent_plans_auto_answers_from_its_cache_and_records_the_choice(tmp_path: Path, monkeypatch):
    from test_agent_logic import make_agent
    from slurmckpt.policy import JobPolicy
    FakeSlurm(sacct="NODE_FAIL|3600|1\nCOMPLETED|3600|1\n").install(monkeypatch)
    a = make_agent(tmp_path)
    a.facts.config = Config(run_dir=str(tmp_path / "run"), interruption_mtbi=7200, auto_first_interval=300)
    a.facts.policy = JobPolicy(min_interval=60, min_from="partition debug", max_interval=3600, max_from="QOS q")
    a.facts.slurm_job = dataclasses.replace(a.facts.slurm_job, partition="debug", nodes=("n1", "n2"))
    a.facts.events = None
    plan = a.plan._auto_plan()
    assert plan == {"min_s": 60, "max_s": 3600, "first_s": 300, "mtbi_s": 3600.0, "min_from": "partition debug",
                    "max_from": "QOS q", "stalls": []}
    first = a.job.interruptions({}, [])
    assert first["source"] == "pending" and first["mtbi_s"] == 3600
    a.job.history._thread.join(10)
    got = a.job.interruptions({}, [])
    assert (got["source"], got["interruptions"], got["node_s"], got["nodes"]) == ("accounting", 1, 7200.0, 2)
    assert got["mtbi_s"] == pytest.approx((7200 + 7200) / 2 / 2)
    assert (tmp_path / "run" / "interruptions" / "c.debug.json").exists()
    a.job.interval_chosen({"choice": {"interval_s": 120, "stalls": [0.3, 0.4], "basis": "daly"}}, [])
    assert a.plan._auto_plan()["stalls"] == [0.3, 0.4]                   # the next run of the job starts from them


# ---- the coordinator process -------------------------------------------------------------------------------
def test_the_coordinator_process_chooses_announces_and_re_chooses(monkeypatch):
    """A rank that asks for auto: the coordinator announces the first interval (1 s here), captures, asks the
    agent for the interruption rate, and re-chooses from the measured stall: Daly's interval for a stall of
    ~0 s and M = 2 s is below the minimum of 2 s, so 2 s, the bound named."""
    from test_coordinator_process import Wrapper, rank, shut
    from slurmckpt.coordinator.protocol import new_token
    from slurmckpt.coordinator.supervisor import CoordinatorSupervisor
    wrapper = Wrapper()
    chosen: queue.Queue = queue.Queue()
    asked: list[int] = []
    cb = dataclasses.replace(
        wrapper.callbacks(), interval=lambda choice, line, changed: chosen.put((choice, line, changed)),
        interruptions=lambda: asked.append(1) or {"source": "accounting", "mtbi_s": 2.0, "interruptions": 5,
                                                  "node_s": 10.0, "partition": "debug", "nodes": 1})
    token = new_token()
    auto = {"min_s": 2, "max_s": 3, "first_s": 1, "mtbi_s": 86400.0, "min_from": "the site default",
            "max_from": "", "stalls": []}
    sup = CoordinatorSupervisor(7, {"token": token, "next_epoch": 1, "completed": {}, "prepare_timeout_s": 10,
                                    "capture_timeout_s": 10, "lock_rounds": 1, "auto": auto}, cb)
    port = sup.start()
    commands: list = []
    client = rank(port, token, commands, interval=AUTO)
    try:
        choice, line, changed = chosen.get(timeout=20)
        assert (choice["interval_s"], choice["basis"], changed) == (2, "first", True)   # 1 s, raised to the min
        assert line == "checkpoint interval auto: 2s (no capture measured yet; min_interval 2s of the site default)"
        seen = [chosen.get(timeout=20) for _ in range(2)]       # after the agent's answer and after the commit
        result = wrapper.results.get(timeout=20)
        assert result["status"] == "committed" and 0 <= result["stall_s"] <= result["frozen_s"]
        deadline = time.monotonic() + 20
        while not any(c["basis"] == "daly" for c, _, _ in seen) and time.monotonic() < deadline:
            seen.append(chosen.get(timeout=20))
    finally:
        client.close()
        shut(sup)
    daly_choice = next(c for c, _, _ in seen if c["basis"] == "daly")
    assert daly_choice["interval_s"] == 2 and daly_choice["bound"] == "min_interval" and daly_choice["mtbi_s"] == 2.0
    assert daly_choice["stalls"] and asked


def test_choices_sent_in_a_loop_reach_the_shared_summary_at_most_once_a_second(tmp_path: Path, monkeypatch):
    """interval_chosen is the job's wrapper's to send as often as it likes: the record is written each time,
    the summary on the shared file system is published once for every call within a second."""
    from test_observability import Slurm, _events
    events = _events(tmp_path, None, Slurm())
    published: list[float] = []
    monkeypatch.setattr(summary, "publish", lambda store, d, uid: published.append(time.monotonic()))
    for _ in range(50):
        events.publish_soon(delay_s=0.3)
    time.sleep(0.6)
    events.publish_soon(delay_s=0.3)
    time.sleep(0.6)
    assert len(published) == 2
