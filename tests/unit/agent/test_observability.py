"""What an agent tells the world (events.py): one key=value line per event into the plugin's log relay (a
real pipe here; the relay itself: spank/tests/log_relay_test.c), the job's comment field through its one
writer (store/job_comment.py), the user-readable summary (summary.py), and the agent's own log (agent/logs.py)."""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from slurmckpt.agent import logs as agentlog
from slurmckpt.store import summary
from slurmckpt.config import Config
from slurmckpt.agent.events import MAX_LINE, AgentEvents, SlurmdLog, Task
from slurmckpt.store.fresh_start import FailureReporter
from slurmckpt.agent.metrics import NodeMetrics
from slurmckpt.slurm.comment import MAX_FIELD, Checkpoint, compose, foreign_part
from slurmckpt.store.job_comment import CHECKPOINT_EVERY_S, JobComment
from slurmckpt.errors import SlurmError
from slurmckpt.slurm.control import JobEnded
from slurmckpt.store.jobstore import JobStore
from slurmckpt.store.record import Capture, Tree


class Slurm:
    """What scontrol would hold: the job's fields, and every update sent."""

    def __init__(self, **fields: str) -> None:
        self.fields, self.sent = dict(fields), []

    def write(self, job: int, field: str, text: str) -> str:
        self.sent.append((job, field, text))
        self.fields[field] = text
        return field

    def read(self, job: int) -> dict[str, str]:
        return dict(self.fields)


def _store(tmp_path: Path, job: int = 7) -> JobStore:
    store = JobStore(tmp_path / "images", "c", job)
    store.ensure()
    return store


def _commit_epoch(store: JobStore, epoch: int, size: int, node: str = "n1") -> dict:
    rdir = store.rank_dir(epoch, "batch", 0)
    rdir.mkdir(parents=True)
    (rdir / "pages-1.img").write_bytes(b"x" * size)
    store.write_rank_manifest(epoch, "batch", 0, Capture(Tree(node=node)))
    ranks = {"batch.0": {"kind": "image", "node": node}}
    store.commit(epoch, ranks, "interval", 2)
    return ranks


# ---- the comment field -------------------------------------------------------------------------------------
def test_the_field_keeps_the_note_and_the_newest_checkpoint_and_other_tools_text(tmp_path: Path):
    slurm = Slurm(AdminComment="site: billing=gpu")
    c = JobComment(_store(tmp_path), 7, "AdminComment", slurm.write, slurm.read, background=False)
    assert c.note(7, "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet") == "AdminComment"
    assert slurm.fields["AdminComment"] == ("site: billing=gpu slurmckpt: started from the beginning (restart 1): "
                                            "no checkpoint committed yet")
    at = time.mktime((2026, 12, 3, 18, 20, 1, 0, 0, -1))
    c.checkpoint(4, at, 3 * 2**20 + 2**19, final=True)
    assert slurm.fields["AdminComment"] == ("site: billing=gpu slurmckpt: started from the beginning (restart 1): no "
                                            "checkpoint committed yet; last checkpoint: epoch 4 at "
                                            "2026-12-03T18:20:01, 3.5 MiB")
    assert foreign_part(slurm.fields["AdminComment"]) == "site: billing=gpu"


def test_a_note_alone_reads_as_before_and_none_writes_nothing(tmp_path: Path):
    """docs/contracts.md's fresh-start line is the whole field while nothing was committed."""
    slurm = Slurm()
    JobComment(_store(tmp_path), 7, "AdminComment", slurm.write, slurm.read, background=False).note(
        7, "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet")
    assert slurm.fields["AdminComment"] == "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet"
    off = JobComment(_store(tmp_path, 8), 8, "none", slurm.write, slurm.read, background=False)
    assert off.note(8, "x") == "none"
    off.checkpoint(1, 0, 1, final=True)
    assert len(slurm.sent) == 1


def test_checkpoint_updates_reach_slurmctld_at_most_once_a_minute_with_the_newest_state(tmp_path: Path):
    slurm, now = Slurm(), [1000.0]
    c = JobComment(_store(tmp_path), 7, "Comment", slurm.write, slurm.read, background=False,
                   clock=lambda: now[0])
    c.checkpoint(1, 0, 10)
    c.checkpoint(2, 0, 20)          # within the minute: deferred (a timer), not sent now
    c.checkpoint(3, 0, 30)
    assert len(slurm.sent) == 1 and "epoch 1" in slurm.sent[0][2]
    c.flush()                       # what the agent does before it exits
    assert len(slurm.sent) == 2 and "epoch 3" in slurm.sent[1][2] and slurm.sent[1][1] == "Comment"
    now[0] += CHECKPOINT_EVERY_S + 1
    c.checkpoint(4, 0, 40)
    assert len(slurm.sent) == 3 and "epoch 4" in slurm.sent[2][2]
    c.flush()
    assert len(slurm.sent) == 3


@pytest.mark.parametrize("refusal, level", [(JobEnded, logging.INFO), (SlurmError, logging.ERROR)])
def test_a_last_update_that_races_the_jobs_end_is_no_error(tmp_path: Path, caplog, refusal: type, level: int):
    """The agent flushes the field as the job ends; slurmctld may already have closed the job."""
    def refused(job: int, field: str, text: str) -> str:
        raise refusal("neither AdminComment nor Comment could be set")
    c = JobComment(_store(tmp_path), 7, "AdminComment", refused, Slurm().read, background=False)
    with caplog.at_level(logging.INFO, logger="slurmckpt.comment"):
        c.checkpoint(3, 0, 10, final=True)
    record = [r for r in caplog.records if "AdminComment" in r.getMessage()][-1]
    assert record.levelno == level


def test_the_field_is_one_printable_line_cut_in_the_note_never_in_the_checkpoint():
    text = compose("a\nb\x1b[2J" + "x" * 2000, Checkpoint(9, 0, 5), foreign="other tool")
    assert len(text) <= MAX_FIELD and text.isprintable() and "\n" not in text
    assert text.startswith("other tool slurmckpt: a b?[2J") and text.endswith(", 5 B")
    assert "last checkpoint: epoch 9" in text


# ---- the summary ----------------------------------------------------------------------------------------------
@pytest.mark.system
def test_the_summary_is_roots_readable_by_the_jobs_user_and_rebuilt_from_the_store(tmp_path: Path):
    """Root's file, 0440 by an ACL naming the job's uid (tests/unit/store/test_summary.py tries it as the users)."""
    store = _store(tmp_path)
    _commit_epoch(store, 3, 4096)
    summary.update_run(store, {"restart_count": 1, "interval_s": 600})
    summary.update_run(store, {"restored_epoch": 3})
    out = summary.publish(store, str(tmp_path / "summaries"), uid=1001)
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o440)
    for d in (out.parent, out.parent.parent):
        assert (d.stat().st_uid, stat.S_IMODE(d.stat().st_mode)) == (0, 0o755)
    data = summary.read(str(tmp_path / "summaries"), "c", 7)
    assert data["epochs"][0]["epoch"] == 3 and data["epochs"][0]["bytes"] == 4096
    assert data["epochs"][0]["nodes"] == ["n1"] and data["run"] == {"restart_count": 1, "interval_s": 600,
                                                                    "restored_epoch": 3}
    out.chmod(0o600)                        # whatever was there is replaced, never read back
    out.write_text(json.dumps({"epochs": [{"epoch": 99}]}))
    summary.publish(store, str(tmp_path / "summaries"), uid=1001)
    assert summary.read(str(tmp_path / "summaries"), "c", 7)["epochs"][0]["epoch"] == 3
    summary.update_run(store, {"restart_count": 2})           # a new run starts a new record
    assert summary.build(store)["run"] == {"restart_count": 2}


def test_a_summary_directory_a_user_could_swap_is_refused(tmp_path: Path):
    from slurmckpt.errors import PermissionDenied
    store = _store(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "summaries").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "summaries" / "c")
    with pytest.raises(PermissionDenied, match="not a root-owned directory"):
        summary.publish(store, str(tmp_path / "summaries"), uid=1001)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    os.unlink(tmp_path / "summaries" / "c")
    (tmp_path / "summaries" / "c").mkdir(mode=0o777)
    os.chmod(tmp_path / "summaries" / "c", 0o777)
    with pytest.raises(PermissionDenied):
        summary.publish(store, str(tmp_path / "summaries"), uid=1001)


# ---- events ----------------------------------------------------------------------------------------------------
def _events(tmp_path: Path, fd: int | None, slurm: Slurm, step: str = "batch") -> AgentEvents:
    store = _store(tmp_path)
    config = Config.from_mapping({"summary_dir": str(tmp_path / "summaries")})
    return AgentEvents(Task(7, step, 0, 1001, "n1"), store, config, SlurmdLog(fd),
                       JobComment(store, 7, "AdminComment", slurm.write, slurm.read, background=False),
                       NodeMetrics(str(tmp_path / "m.prom"), str(tmp_path / "run"), f"7.{step}.0", node="n1"))


def _lines(r: int) -> list[str]:
    os.set_blocking(r, False)
    try:
        return os.read(r, 1 << 16).decode().splitlines()
    except BlockingIOError:
        return []


@pytest.mark.system
def test_events_write_one_relay_line_each_and_feed_metrics_comment_and_summary(tmp_path: Path):
    r, w = os.pipe()
    slurm = Slurm()
    ev = _events(tmp_path, w, slurm)
    ev.started(1, 600, {"allowed": True}, None)
    ranks = _commit_epoch(ev.store, 2, 2048)
    ev.preparing(2)
    ev.captured(2, "interval", False, 2048)
    ev.resumed(2)
    ev.committed(2, "interval", ranks, final=True)
    ev.restored(2, 1.234)
    reporter = FailureReporter(ev.store, 7, "batch.0", "n1", annotate=ev.note, background=False,
                               on_recorded=ev.capture_failed)
    reporter.capture_failed(3, "dump", "criu said\nno", final=False, trigger="sigterm")
    reporter.capture_failed(3, "capture", "seen again by the coordinator", final=False, trigger="sigterm")
    lines = _lines(r)
    assert len(lines) == 3, lines
    assert lines[0] == "info job=7 rank=batch.0 node=n1 event=commit epoch=2 trigger=interval final=true ranks=1 " \
                       "nodes=n1 bytes=2048"
    assert lines[1] == "info job=7 rank=batch.0 node=n1 event=restore epoch=2 seconds=1.23"
    assert lines[2].startswith("error job=7 rank=batch.0 node=n1 event=capture-failed epoch=3 final=false "
                               "trigger=sigterm stage=dump failed_rank=batch.0 seen_by=agent reason=\"criu said no\"")
    assert len(lines) == 3
    assert "last checkpoint: epoch 2" in slurm.fields["AdminComment"]
    data = summary.read(str(tmp_path / "summaries"), "c", 7)
    assert data["epochs"][0]["bytes"] == 2048 and data["failed_captures"][0]["stage"] == "dump"
    assert data["run"]["restored_epoch"] == 2
    prom = (tmp_path / "m.prom").read_text()
    for want in ('slurmckpt_captures_total{node="n1",trigger="interval"} 1',
                 'slurmckpt_commits_total{node="n1",trigger="interval"} 1',
                 'slurmckpt_capture_failures_total{node="n1",stage="dump"} 1', 'slurmckpt_stall_seconds_count{node="n1"} 1',
                 'slurmckpt_restores_total{node="n1",result="ok"} 1', 'slurmckpt_agents{node="n1"} 1',
                 'slurmckpt_persists_pending{node="n1"} 0'):
        assert want in prom, want
    ev.stopped()
    assert 'slurmckpt_agents{node="n1"} 0' in (tmp_path / "m.prom").read_text()


def test_a_relay_that_is_full_or_gone_costs_lines_never_the_agent(tmp_path: Path):
    r, w = os.pipe()
    ev = _events(tmp_path, w, Slurm())
    for _ in range(200):                    # far beyond the pipe's 64 KiB: lines are dropped, nothing blocks
        ev.restore_failed(1, "x" * 2000)
    assert all(len(line) < MAX_LINE for line in _lines(r))
    os.close(r)
    ev.restored(1, 0.1)                     # EPIPE: the relay is dropped
    assert ev.relay.fd is None
    assert not os.get_inheritable(w)


@pytest.mark.system
def test_the_fresh_start_note_goes_to_the_comment_the_summary_and_slurmds_log(tmp_path: Path):
    r, w = os.pipe()
    slurm = Slurm()
    ev = _events(tmp_path, w, slurm)
    reporter = FailureReporter(ev.store, 7, "batch.0", "n1", annotate=ev.note, background=False,
                               on_recorded=ev.capture_failed)
    notice = reporter.fresh_start(1, None)
    ev.fresh_start(notice)
    assert slurm.fields["AdminComment"] == "slurmckpt: started from the beginning (restart 1): no checkpoint committed yet"
    assert _lines(r) == ["info job=7 rank=batch.0 node=n1 event=note text=\"started from the beginning (restart 1): "
                         "no checkpoint committed yet\""]
    assert summary.read(str(tmp_path / "summaries"), "c", 7)["run"]["fresh_start"] == notice


# ---- the agent's log --------------------------------------------------------------------------------------------
def test_agent_log_files_rotate_by_size_and_old_ones_are_removed(tmp_path: Path):
    config = Config.from_mapping({"log_dir": str(tmp_path / "logs"), "log_max_bytes": "2KiB", "log_backups": 2,
                                  "log_keep_days": 14})
    (tmp_path / "logs").mkdir()
    old = tmp_path / "logs" / "agent-1.batch.0.log"
    old.write_text("old\n")
    os.utime(old, (time.time() - 15 * 86400,) * 2)
    keep = tmp_path / "logs" / "agent-2.batch.0.log.1"
    keep.write_text("recent\n")
    agentlog.setup(config, 9, "batch", 0)
    try:
        for i in range(200):
            logging.getLogger("slurmckpt.agent").info("record %d %s", i, "y" * 40)
    finally:
        for h in list(logging.getLogger().handlers):
            h.close()
            logging.getLogger().removeHandler(h)
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["agent-2.batch.0.log.1", "agent-9.batch.0.log", "agent-9.batch.0.log.1", "agent-9.batch.0.log.2"]
    assert all((tmp_path / "logs" / n).stat().st_size <= 2048 + 200 for n in names)
    last = (tmp_path / "logs" / "agent-9.batch.0.log").read_text().splitlines()[-1]
    assert "slurmckpt.agent job=9 step=batch rank=0 pid=" in last and "record 199" in last


def test_agent_log_to_syslog_reaches_the_socket_with_job_step_rank(tmp_path: Path):
    path = str(tmp_path / "log.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    sink.settimeout(5)
    config = Config.from_mapping({"log_target": "syslog", "syslog_address": path})
    agentlog.setup(config, 9, "3", 1)
    try:
        logging.getLogger("slurmckpt.agent").warning("hello syslog")
        data = sink.recv(4096).decode()
    finally:
        for h in list(logging.getLogger().handlers):
            h.close()
            logging.getLogger().removeHandler(h)
        sink.close()
    assert data.startswith("<28>slurmckpt-agent: slurmckpt.agent job=9 step=3 rank=1 pid=")    # daemon.warning
    assert data.rstrip("\x00").endswith("WARNING hello syslog")


def test_no_syslog_daemon_falls_back_to_the_file_and_says_why(tmp_path: Path):
    config = Config.from_mapping({"log_target": "syslog", "syslog_address": str(tmp_path / "none.sock"),
                                  "log_dir": str(tmp_path / "logs")})
    handler = agentlog.handler_for(config, 9, "batch", 0)
    handler.close()
    assert "unreachable" in (tmp_path / "logs" / "agent-9.batch.0.log").read_text()


FORGED = "2030-01-01 00:00:00,000 slurmckpt.agent job=1 step=batch rank=0 pid=1 INFO forged"


@pytest.mark.parametrize("target", ["file", "syslog"])
def test_user_strings_never_forge_a_record_in_the_agent_log(tmp_path: Path, target: str):
    """argv[0], paths and criu's log of the user's files reach log records as they are: newlines, carriage
    returns, escape sequences, line separators and bidi overrides. Every record is one line of printable
    text (agentlog.escape in the formatter), its traceback included; on the old formatter the first record
    was three lines, the second a forged record of its own."""
    sink = None
    if target == "syslog":
        sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sink.bind(str(tmp_path / "log.sock"))
        sink.settimeout(5)
    config = Config.from_mapping({"log_dir": str(tmp_path / "logs"), "log_target": target,
                                  "syslog_address": str(tmp_path / "log.sock")})
    agentlog.setup(config, 9, "batch", 0)
    log = logging.getLogger("slurmckpt.agent")
    try:
        log.info("launched %s as pid %d", f"./x\n{FORGED}\r\x1b[2J\u2028\u202e", 42)
        try:
            raise OSError(f"no such file: /home/u/a\n{FORGED}")
        except OSError:
            log.exception("restore failed")
        data = (tmp_path / "logs" / "agent-9.batch.0.log").read_text() if sink is None else \
            sink.recv(4096).decode() + "\n" + sink.recv(8192).decode()
    finally:
        for h in list(logging.getLogger().handlers):
            h.close()
            logging.getLogger().removeHandler(h)
        if sink:
            sink.close()
    lines = data.rstrip("\n").split("\n")
    assert len(lines) == 2 and not any(line.startswith("2030-") for line in lines), lines
    assert "launched ./x\\n2030-01-01 00:00:00,000 slurmckpt.agent" in lines[0]
    assert lines[0].rstrip("\x00").endswith("\\r\\x1b[2J\\u2028\\u202e as pid 42"), lines[0]
    assert "restore failed\\nTraceback (most recent call last):\\n" in lines[1] and "\\n2030-01-01" in lines[1]
    assert all(line.rstrip("\x00").isprintable() for line in lines)
    assert agentlog.escape("plain text: ü ✓") == "plain text: ü ✓"
