"""Why a job starts from the beginning (fresh_start.py): the capture-failure record in the job's store, the
one-line reason (sanitized: it carries user-controlled text), the fresh-start line and the AdminComment
the agent sends, and the agent operations that feed them."""
from __future__ import annotations

import json
import re
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmckpt.store import fresh_start
from slurmckpt.agent.plan import TaskPlan
from slurmckpt.agent.service import Agent
from slurmckpt.identity import TaskIdentity
from slurmckpt.errors import CaptureError, CriuError, ProtocolError
from slurmckpt.store.fresh_start import (FAILURES_FILE, CaptureFailure, FailureReporter, coordinator_verdict, failures,
                                   no_checkpoint_reason, one_line, reason_of, record)
from slurmckpt.store.jobstore import JobStore

from test_coordinator import Committer, Job  # noqa: E402  (tests/unit helpers)
from fake_runner import fake_runner

HOSTILE = "sock \x1b[2J\x1b]0;pwned\x07 /tmp/a\nb\r\tc \u202etxt.exe \x00end"


def _store(tmp_path: Path) -> JobStore:
    (tmp_path / "images").mkdir(parents=True, exist_ok=True)
    store = JobStore(tmp_path / "images", "c", 43)
    store.ensure()
    return store


def _failure(epoch: int, final: bool | None = True, trigger: str = "sigterm", reason: str = "refused") -> CaptureFailure:
    return CaptureFailure(epoch, 1000.0 + epoch, "batch.0", "node1", final, trigger, "check", reason, "agent")


class Notes:
    """The AdminComment side: what the reporter would have sent to Slurm."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, job: int, text: str) -> str:
        self.sent.append((job, text))
        return "AdminComment"


def _reporter(store: JobStore, notes: Notes) -> FailureReporter:
    return FailureReporter(store, 43, "batch.0", "node1", annotate=notes, background=False)


# ---- sanitizing ---------------------------------------------------------------------------------------------
def test_one_line_leaves_no_control_character_newline_or_overlong_text() -> None:
    text = one_line(HOSTILE)
    assert text.isprintable() and "\n" not in text and "\x1b" not in text and "\u202e" not in text
    assert text.startswith("sock ?[2J?]0;pwned? /tmp/a b c ?txt.exe ?end")
    long = one_line("x" * 5000, 100)
    assert len(long) == 100 and long.endswith("...")
    assert one_line(ValueError("a\nb")) == "a b"


def test_a_criu_failure_gives_its_message_and_criu_s_own_last_error_line() -> None:
    e = CriuError("criu dump exited 1", log_tail="(00.1) Warn: x\n(00.2) Error (criu/files-reg.c:1): Can't dump "
                                                "ghost file /tmp/seg of 4194304 size, increase limit\n(00.3) done\n")
    assert reason_of(e) == ("criu dump exited 1; criu: (00.2) Error (criu/files-reg.c:1): Can't dump ghost file "
                            "/tmp/seg of 4194304 size, increase limit")
    assert reason_of(CaptureError("one\ntwo", step="batch", rank=0)) == "one two [step=batch rank=0]"


# ---- the record ---------------------------------------------------------------------------------------------
def test_record_is_a_root_only_file_with_one_record_per_epoch_newest_first_and_bounded(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert record(store, _failure(3, reason="first"))
    assert not record(store, _failure(3, reason="second"))          # the first that saw the epoch stays
    for epoch in range(4, 4 + fresh_start.KEEP + 5):
        record(store, _failure(epoch, final=False, trigger="interval"))
    got = failures(store)
    assert len(got) == fresh_start.KEEP and got[0].epoch == 3 + fresh_start.KEEP + 5
    assert [f.epoch for f in got] == sorted((f.epoch for f in got), reverse=True)
    path = store.job_dir / FAILURES_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in store.job_dir.iterdir() if p.name.startswith(".")] == []    # no temp file left


def test_an_unreadable_record_reads_as_none_and_the_next_failure_replaces_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (store.job_dir / FAILURES_FILE).write_text("{not json")
    assert failures(store) == []
    assert record(store, _failure(2))
    assert [f.epoch for f in failures(store)] == [2]
    (store.job_dir / FAILURES_FILE).write_text(json.dumps({"failures": [{"epoch": 1}]}))    # fields missing
    assert failures(store) == []


# ---- the reason -----------------------------------------------------------------------------------------------
def test_descriptions_name_the_kind_of_capture_its_epoch_and_rank() -> None:
    assert _failure(3).describe() == "the final capture at epoch 3 failed on rank batch.0: refused"
    assert _failure(2, final=False, trigger="interval").describe().startswith("the interval capture at epoch 2")
    assert _failure(2, final=False, trigger="weird").describe().startswith("the periodic capture at epoch 2")
    assert _failure(2, final=None).describe().startswith("the capture at epoch 2 failed")
    nameless = CaptureFailure(5, 0.0, "", "", True, "sigterm", "timeout", "a rank did not answer", "coordinator")
    assert nameless.describe() == "the final capture at epoch 5 failed: a rank did not answer"


def test_no_checkpoint_reason_says_what_the_store_knows(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert no_checkpoint_reason(store, "batch.0") == "no checkpoint committed yet"
    record(store, _failure(1, final=False, trigger="interval", reason="socket"))
    assert no_checkpoint_reason(store, "batch.0") == ("no checkpoint committed yet; the interval capture at epoch 1 "
                                                      "failed on rank batch.0: socket")
    record(store, _failure(2, reason="socket again"))
    assert no_checkpoint_reason(store, "batch.0") == "the final capture at epoch 2 failed on rank batch.0: socket again"
    manifest = store.read_manifest()
    manifest["rejected"] = [{"epoch": 4, "reason": "rank 0.1 could not restore it: bad size", "at": 0}]
    (store.job_dir / "manifest.json").write_text(json.dumps(manifest))
    assert no_checkpoint_reason(store, "batch.0") == ("checkpoint epoch 4 was withdrawn: rank 0.1 could not restore "
                                                      "it: bad size")
    manifest["epochs"] = [{"epoch": 5, "ranks": {"0.0": {"kind": "image"}}}]
    (store.job_dir / "manifest.json").write_text(json.dumps(manifest))
    assert no_checkpoint_reason(store, "batch.0") == "no committed checkpoint holds task batch.0"


# ---- the reporter (the agent's side) ---------------------------------------------------------------------------
def test_a_failed_final_capture_is_recorded_and_annotated_an_interval_one_only_recorded(tmp_path: Path) -> None:
    store, notes = _store(tmp_path), Notes()
    r = _reporter(store, notes)
    r.capture_failed(1, "check", "refused", False, "interval")
    assert notes.sent == [] and failures(store)[0].epoch == 1
    r.capture_failed(2, "dump", HOSTILE, True, "sigterm")
    assert len(notes.sent) == 1 and notes.sent[0][0] == 43
    text = notes.sent[0][1]
    assert text.startswith("slurmckpt: the final capture at epoch 2 failed on rank batch.0: sock ")
    assert text.isprintable() and failures(store)[0].reason.isprintable()
    r.capture_failed(2, "prepare", "the coordinator's word", True, "sigterm", seen_by="coordinator")
    assert len(notes.sent) == 1 and failures(store)[0].seen_by == "agent"


def test_an_annotation_still_on_its_way_is_sent_before_the_agent_exits(tmp_path: Path) -> None:
    """A failed final capture ends the program at once, so its agent exits right after recording it: the
    AdminComment, sent off the op's path by a daemon thread, is waited for at shutdown, not lost with it."""
    slow = Notes()

    def annotate(job: int, text: str) -> str:
        time.sleep(0.5)                                  # slurmctld answering slowly
        return slow(job, text)
    r = FailureReporter(_store(tmp_path), 43, "batch.0", "node1", annotate=annotate, background=True)
    r.capture_failed(2, "check", "refused", True, "sigterm")
    assert slow.sent == [], "sent off the op's path"
    r.flush(timeout_s=10)
    assert [text for _, text in slow.sent] == ["slurmckpt: the final capture at epoch 2 failed on rank batch.0: refused"]
    assert r.sending == []


def test_the_agent_caps_what_it_sends_to_slurmctld(tmp_path: Path) -> None:
    store, notes = _store(tmp_path), Notes()
    r = _reporter(store, notes)
    for epoch in range(1, 40):
        r.capture_failed(epoch, "check", "refused", True, "sigterm")
    assert len(notes.sent) == fresh_start.MAX_ANNOTATIONS


def test_recorded_phase_names_the_failed_stage_keeps_the_error_and_knows_the_epoch_kind(tmp_path: Path) -> None:
    store, notes = _store(tmp_path), Notes()
    r = _reporter(store, notes)
    runner = fake_runner("stale")
    r.epoch_began(7, None, "sigterm")
    r.epoch_is_final(7, True)
    with pytest.raises(CaptureError, match="unix stream socket"):
        with r.recorded(7, "prepare", runner):
            assert runner.failed_stage == ""          # a stage of an earlier epoch is not this one's
            runner.stage_failed("check")
            raise CaptureError("unix stream socket /tmp/s is connected to ? in a process outside this task")
    f = failures(store)[0]
    assert (f.epoch, f.stage, f.final, f.trigger, f.rank, f.node) == (7, "check", True, "sigterm", "batch.0", "node1")
    with r.recorded(8, "resume", runner):
        pass
    assert [x.epoch for x in failures(store)] == [7]


def test_a_lock_round_the_coordinator_retries_is_not_recorded_its_verdict_is(tmp_path: Path) -> None:
    """A retryable failure (a rank frozen inside a PMI exchange) is one round of several: the agent records
    nothing and annotates nothing; the coordinator's verdict, when the rounds run out, is recorded once."""
    from slurmckpt.errors import ExchangeInFlight
    store, notes = _store(tmp_path), Notes()
    r = _reporter(store, notes)
    runner = fake_runner()
    r.epoch_began(9, True, "sigterm")
    with pytest.raises(ExchangeInFlight):
        with r.recorded(9, "prepare", runner):
            runner.stage_failed("pmi-idle")
            raise ExchangeInFlight("thread 5 of pid 5 waits in read() for slurmstepd's answer")
    assert failures(store) == [] and notes.sent == []
    r.capture_failed(9, "pmi-idle", "thread 5 of pid 5 waits in read()", True, "sigterm", seen_by="coordinator")
    assert [(f.epoch, f.stage, f.seen_by) for f in failures(store)] == [(9, "pmi-idle", "coordinator")]


def test_a_periodic_capture_that_found_the_task_ended_is_not_recorded_a_final_one_is(tmp_path: Path) -> None:
    """TaskEnded in a periodic (or not yet known) epoch is the program's normal end racing the interval:
    nothing recorded, nothing annotated. In a final capture it is recorded like any failure."""
    from slurmckpt.errors import TaskEnded
    store, notes = _store(tmp_path), Notes()
    r = _reporter(store, notes)
    runner = fake_runner()
    for epoch, final in ((3, False), (4, None)):
        r.epoch_began(epoch, final, "interval")
        with pytest.raises(TaskEnded):
            with r.recorded(epoch, "size", runner):
                raise TaskEnded("no running task tree to capture")
    assert failures(store) == [] and notes.sent == []
    r.epoch_began(5, True, "sigterm")
    with pytest.raises(TaskEnded):
        with r.recorded(5, "prepare", runner):
            raise TaskEnded("no running task tree to capture")
    assert [(f.epoch, f.final) for f in failures(store)] == [(5, True)]


def test_fresh_start_line_prefers_restore_failures_then_the_agent_s_refusal_then_the_store(tmp_path: Path) -> None:
    store, notes = _store(tmp_path), Notes()
    record(store, _failure(3, reason="socket"))
    assert _reporter(store, notes).fresh_start(1, None) == ("starting from the beginning (restart 1): the final "
                                                           "capture at epoch 3 failed on rank batch.0: socket")
    assert notes.sent[-1][1] == ("slurmckpt: started from the beginning (restart 1): the final capture at epoch 3 "
                                 "failed on rank batch.0: socket")
    refused = _reporter(store, notes)
    assert refused.fresh_start(2, "images belong to another job instance").endswith(
        "(restart 2): images belong to another job instance")
    failed = _reporter(store, notes)
    failed.restore_failed(3, CriuError("criu restore exited 1", log_tail="Error (x): bad size\n"))
    line = failed.fresh_start(2, "ignored")
    assert line == ("starting from the beginning (restart 2): restore of checkpoint epoch 3 failed: criu restore "
                    "exited 1; criu: Error (x): bad size")
    sent = len(notes.sent)
    assert failed.fresh_start(2, None) == line and len(notes.sent) == sent      # once per task


def test_coordinator_verdict_is_checked_field_by_field() -> None:
    good = {"epoch": 4, "stage": "timeout", "error": "a rank did not answer in time", "final": True,
            "trigger": "sigterm", "rank": None, "node": "?"}
    assert coordinator_verdict(good) == {"epoch": 4, "stage": "timeout", "reason": "a rank did not answer in time",
                                         "final": True, "trigger": "sigterm", "rank": "", "node": "",
                                         "seen_by": "coordinator"}
    for bad in ({"rank": "../../etc"}, {"epoch": 0}, {"stage": "a b"}, {"final": "yes"}, {"node": "a/b"},
                {"error": "x" * 70000}, {"trigger": "\n"}):
        with pytest.raises(ProtocolError):
            coordinator_verdict({**good, **bad})


# ---- the agent operations ------------------------------------------------------------------------------------
def _agent(tmp_path: Path, restart_count: int, notes: Notes, fail: str | None = None) -> Agent:
    from test_agent_logic import assemble
    store = _store(tmp_path)

    def prepare(epoch: int) -> dict:
        if fail:
            a.tree.runner.stage_failed("check")
            raise CaptureError(fail, step="batch", rank=0)
        return {}
    a = assemble(TaskIdentity("c", 43, "batch", 0, 1001, 1001, restart_count), store,
                 runner=fake_runner(prepare=prepare, killed_for=""),
                 reporter=_reporter(store, notes))
    return a


def test_the_batch_agent_of_a_requeued_job_says_why_it_starts_afresh_and_a_first_run_says_nothing(
        tmp_path: Path, monkeypatch) -> None:
    notes = Notes()
    first = _agent(tmp_path / "first", 0, notes)
    assert first.plan.fresh_start({}, []) == {"notice": None} and notes.sent == []
    again = _agent(tmp_path / "again", 1, notes)
    monkeypatch.setattr(TaskPlan, "not_restorable", lambda self: None)
    assert again.plan.fresh_start({}, [])["notice"] == ("starting from the beginning (restart 1): no checkpoint "
                                                      "committed yet")
    assert notes.sent == [(43, "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet")]
    restored = _agent(tmp_path / "restored", 1, notes)
    restored.plan.restored = 2
    assert restored.plan.fresh_start({}, []) == {"notice": None}


def test_a_refused_prepare_is_recorded_by_the_rank_s_agent_before_the_error_reaches_the_coordinator(
        tmp_path: Path) -> None:
    notes = Notes()
    a = _agent(tmp_path, 0, notes, fail="unix stream socket /x is connected to ? in a process outside this task")
    with pytest.raises(CaptureError):
        a.epochs.prepare({"epoch": 3, "final": True, "trigger": "sigterm"}, [])
    f = failures(a.facts.store)[0]
    assert (f.epoch, f.stage, f.final, f.trigger, f.seen_by) == (3, "check", True, "sigterm", "agent")
    assert "unix stream socket /x" in f.reason and notes.sent[0][1].startswith("slurmckpt: the final capture at epoch 3")
    a.job.capture_failed({"epoch": 3, "final": True, "trigger": "sigterm", "stage": "prepare", "rank": "batch.0",
                         "node": "node1", "error": "something else"}, [])
    assert failures(a.facts.store)[0].reason == f.reason          # the rank's own record stays
    a.job.capture_failed({"epoch": 4, "final": False, "trigger": "interval", "stage": "timeout",
                         "error": "a rank did not answer in time"}, [])
    assert failures(a.facts.store)[0].describe() == "the interval capture at epoch 4 failed: a rank did not answer in time"


def test_the_coordinator_tells_ranks_in_prepare_whether_the_capture_is_final_and_why() -> None:
    job = Job(Committer())
    try:
        rank = job.rank("0.0")
        seen: list[dict] = []
        handle = rank.client.handler
        rank.client.handler = lambda kind, epoch, message: (seen.append(dict(message, kind=kind)),
                                                            handle(kind, epoch, message))[1]
        assert job.epoch("sigterm", final=True)["status"] == "committed"
        prepare = next(m for m in seen if m["kind"] == "prepare")
        assert prepare["final"] is True and prepare["trigger"] == "sigterm"
    finally:
        job.close()


def test_record_never_follows_a_path_it_did_not_make(tmp_path: Path) -> None:
    """The record's name is fixed in the root-owned job directory; a symlink planted there (only root could)
    is replaced by the rename, never written through."""
    store = _store(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, store.job_dir / FAILURES_FILE)
    record(store, _failure(1))
    assert target.read_text() == "keep" and not (store.job_dir / FAILURES_FILE).is_symlink()


def test_a_restore_of_an_older_epoch_after_a_failed_capture_says_what_is_lost(tmp_path: Path, monkeypatch) -> None:
    """The final capture failed but an earlier epoch is committed: the batch step restores that one, and its
    plan says what that costs on the candidate (the wrapper's restore line): how old it was at the requeue
    and which final capture was lost, and why. A newer periodic capture that failed is a warning."""
    notes = Notes()
    a = _agent(tmp_path, 1, notes)
    a.tree.cgroup = SimpleNamespace(path=tmp_path / "cg")
    monkeypatch.setattr(TaskPlan, "not_restorable", lambda self: None)
    manifest = a.facts.store.read_manifest()
    manifest["epochs"] = [{"epoch": 2, "reason": "interval", "committed_at": 0, "ranks": {"batch.0": {"kind": "image"}}}]
    (a.facts.store.job_dir / "manifest.json").write_text(json.dumps(manifest))
    assert "warning" not in a.plan.plan({}, [])
    record(a.facts.store, _failure(3, reason="ghost file too large"))
    plan = a.plan.plan({}, [])
    assert "warning" not in plan
    assert re.fullmatch(r"taken \d+ s before the requeue; the final capture \(epoch 3\) was lost: ghost file too large",
                        plan["candidates"][0]["cost"]), plan
    record(a.facts.store, CaptureFailure(4, 0.0, "batch.0", "n1", False, "interval", "dump", "criu failed", "agent"))
    assert a.plan.plan({}, [])["warning"] == ("the interval capture at epoch 4 failed on rank batch.0: criu failed; "
                                            "restoring the older checkpoint epoch 2")


# ---- the wrapper's side (fakes of tests/unit/task/test_wrapper_logic.py) ----------------------------------------------
import test_wrapper_logic as wrapper_fakes  # noqa: E402

image, restores = wrapper_fakes.image, wrapper_fakes.restores
make, said, slurm = wrapper_fakes.make, wrapper_fakes.said, wrapper_fakes.slurm     # fixtures, by name

NOTICE = "starting from the beginning (restart 1): no checkpoint committed yet"


def test_a_batch_step_that_restores_nothing_prints_the_agent_s_reason_before_the_workload_starts(make, said):
    printed_at_launch: list[int] = []
    w = make({"fresh_start": {"notice": NOTICE},
              "launch": lambda args: (printed_at_launch.append(len(said)), {"pid": 99})[1]}, step="batch")
    w.task.start({"candidates": []}, w.env, w.srun_relay)
    assert w.agent.ops() == ["fresh_start", "launch"] and said == [NOTICE] and printed_at_launch == [1]


def test_a_batch_step_whose_restores_all_failed_asks_for_the_reason_after_the_last_one(make, said):
    w = make({"restore": restores({5, 4}), "fresh_start": {"notice": NOTICE}, "launch": {"pid": 99}}, step="batch")
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert w.agent.ops() == ["restore", "restore", "fresh_start", "launch"] and said[-1] == NOTICE
    assert not any(line == "no checkpoint could be restored: starting the task from the beginning" for line in said)


def test_prepare_tells_the_agent_the_capture_s_finality_and_trigger(make):
    w = make({"prepare": {}})
    w.epochs.on_command("prepare", 3, {"type": "prepare", "epoch": 3, "final": True, "trigger": "sigterm"})
    assert w.agent.calls == [("prepare", {"epoch": 3, "final": True, "trigger": "sigterm", "nfds": 0})]


def test_the_hosting_wrapper_relays_its_coordinator_s_verdict_on_an_aborted_epoch(make, said):
    w = make({"capture_failed": {}})
    w.epochs.epoch_result({"status": "aborted", "epoch": 6, "stage": "timeout", "error": "a rank did not answer in time"},
                    "sigterm", True)
    deadline = time.monotonic() + 5
    while "capture_failed" not in w.agent.ops() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.agent.calls == [("capture_failed", {"epoch": 6, "final": True, "trigger": "sigterm", "stage": "timeout",
                                                 "rank": None, "node": None, "error": "a rank did not answer in time",
                                                 "nfds": 0})]
    assert any("ABORTED" in line for line in said)
