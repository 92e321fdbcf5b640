"""The node's metrics file (metrics.py) is valid Prometheus text exposition format, read with Prometheus's own
Python parser (prometheus_client.parser), counts what several agent processes of a node add up to, drops the
gauges of agents that are gone, and is replaced atomically (node_exporter never reads half a file)."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmckpt.agent.metrics import MAX_LABEL_VALUES, METRICS, SECONDS_BUCKETS, NodeMetrics, read_state, render


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, node: str = "n1") -> dict[tuple, float]:
    """name, labels but the node's -> value; every sample must carry the node's label."""
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            labels = dict(s.labels)
            assert labels.pop("node") == node, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_an_empty_node_still_declares_every_metric_with_help_and_type(tmp_path: Path):
    text = render({}, now=1700000000.5, node="n1")
    fams = families(text)
    for m in METRICS:
        base = m.name.removesuffix("_total") if m.kind == "counter" else m.name
        assert base in fams, m.name
        assert fams[base].type == m.kind and fams[base].documentation == m.help
    s = samples(text)
    assert s[("slurmckpt_captured_bytes_total", ())] == 0
    assert s[("slurmckpt_stall_seconds_count", ())] == 0
    assert s[("slurmckpt_metrics_updated_timestamp_seconds", ())] == 1700000000.5


def test_counters_histograms_and_label_values_as_prometheus_reads_them(tmp_path: Path):
    m = NodeMetrics(str(tmp_path / "prom" / "slurmckpt-%n.prom"), str(tmp_path / "run"), "7.batch.0", node="n1",
                    clock=lambda: 1700000000.0)
    m.count("slurmckpt_captures_total", "interval")
    m.count("slurmckpt_captures_total", "interval")
    m.count("slurmckpt_captures_total", "sigterm")
    m.count("slurmckpt_capture_failures_total", "dump")
    m.count("slurmckpt_policy_refusals_total", 'partition "quoted"\\ and\nnewline')   # site-named: kept
    m.count("slurmckpt_captured_bytes_total", by=3 * 2**30)
    for seconds in (0.05, 0.3, 7.0, 1000.0):
        m.observe("slurmckpt_stall_seconds", seconds)
    m.observe("slurmckpt_restore_seconds", 2.5)
    text = (tmp_path / "prom" / "slurmckpt-n1.prom").read_text()
    s = samples(text)
    assert s[("slurmckpt_captures_total", (("trigger", "interval"),))] == 2
    assert s[("slurmckpt_captures_total", (("trigger", "sigterm"),))] == 1
    assert s[("slurmckpt_capture_failures_total", (("stage", "dump"),))] == 1
    assert s[("slurmckpt_policy_refusals_total", (("rule", 'partition "quoted"\\ and\nnewline'),))] == 1
    assert s[("slurmckpt_captured_bytes_total", ())] == 3 * 2**30
    buckets = {dict(k[1])["le"]: v for k, v in s.items() if k[0] == "slurmckpt_stall_seconds_bucket"}
    assert buckets["0.1"] == 1 and buckets["0.5"] == 2 and buckets["10.0"] == 3 and buckets["600.0"] == 3
    assert buckets["+Inf"] == 4 and len(buckets) == len(SECONDS_BUCKETS) + 1
    assert s[("slurmckpt_stall_seconds_sum", ())] == pytest.approx(1007.35)
    assert s[("slurmckpt_restore_seconds_count", ())] == 1
    assert not [p for p in (tmp_path / "prom").iterdir() if p.name != "slurmckpt-n1.prom"]   # no temp left


def _agent(state_dir: str, textfile: str, task: str, ready, go) -> None:
    m = NodeMetrics(textfile, state_dir, task, node="n1")
    ready.set()
    go.wait()
    for _ in range(25):
        m.count("slurmckpt_commits_total", "interval")
    m.gauge("slurmckpt_agents", 1)


def test_several_agent_processes_add_up_and_gauges_of_dead_agents_drop_out(tmp_path: Path):
    """Four agent processes update the node's counters at once (POSIX lock on the state file): none of their
    increments is lost. Each set its agents gauge and exited: the next render counts none of them."""
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    readies, procs = [], []
    for i in range(4):
        ready = ctx.Event()
        p = ctx.Process(target=_agent, args=(str(tmp_path), str(tmp_path / "m.prom"), f"7.{i}.0", ready, go))
        p.start()
        readies.append(ready)
        procs.append(p)
    for ready in readies:
        assert ready.wait(30)
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert read_state(str(tmp_path), "n1")["counters"]["slurmckpt_commits_total"]["interval"] == 100
    me = NodeMetrics(str(tmp_path / "m.prom"), str(tmp_path), "8.batch.0", node="n1")
    me.gauge("slurmckpt_agents", 1)
    s = samples((tmp_path / "m.prom").read_text())
    assert s[("slurmckpt_commits_total", (("trigger", "interval"),))] == 100
    assert s[("slurmckpt_agents", ())] == 1                     # this process only: the four exited
    me.gauge("slurmckpt_agents", None)
    assert samples((tmp_path / "m.prom").read_text())[("slurmckpt_agents", ())] == 0


def test_two_nodes_sharing_a_directory_never_collide(tmp_path: Path):
    """Test clusters run several slurmd on one host: their files in one directory, told apart by `node`."""
    for node in ("node1", "node2"):
        NodeMetrics(str(tmp_path / "slurmckpt-%n.prom"), str(tmp_path), "7.batch.0", node=node).count(
            "slurmckpt_commits_total", "interval")
    seen = [(s.name, tuple(sorted(s.labels.items()))) for n in ("node1", "node2")
            for f in text_string_to_metric_families((tmp_path / f"slurmckpt-{n}.prom").read_text()) for s in f.samples]
    assert len(seen) == len(set(seen)) and ("slurmckpt_commits_total", (("node", "node2"), ("trigger", "interval"))) in seen


def test_a_gauge_entry_of_a_reused_pid_does_not_count(tmp_path: Path):
    """An entry names the agent's pid and start time: another process with that pid is not that agent."""
    state = {"gauges": {"slurmckpt_persists_pending": {
        "1.batch.0": {"value": 1, "pid": os.getpid(), "started": 1.0},
        "2.batch.0": {"value": 1, "pid": 2**22 + 7, "started": 1.0}}}}
    assert samples(render(state, 0, "n1"))[("slurmckpt_persists_pending", ())] == 0


def test_an_unwritable_textfile_never_fails_the_caller(tmp_path: Path):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    target = tmp_path / "ro" / "sub" / "m.prom"
    NodeMetrics(str(target), str(tmp_path / "run"), "t", node="n1").count("slurmckpt_captures_total", "x")
    if os.geteuid() != 0:          # root writes anyway; the point is that nothing raised
        assert not target.exists()
    with pytest.raises(ValueError):
        NodeMetrics("", str(tmp_path / "run"), "t").count("slurmckpt_no_such_metric")


def test_the_file_is_world_readable_whatever_the_umask(tmp_path: Path):
    """node_exporter may run as its own user (Debian: prometheus); slurmstepd's umask is not ours to trust."""
    old = os.umask(0o077)
    try:
        NodeMetrics(str(tmp_path / "new" / "m.prom"), str(tmp_path / "run"), "t", node="n1").count(
            "slurmckpt_captures_total", "interval")
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "m.prom").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755


def test_label_values_a_job_chooses_add_no_series_and_the_state_stays_small(tmp_path: Path):
    """A job's own coordinator names the trigger and the failed stage: 3000 different ones are counted as
    "other", the series stay the fixed set, and the state file stays small. Site-named labels (policy rules)
    keep at most MAX_LABEL_VALUES values."""
    m = NodeMetrics(str(tmp_path / "m.prom"), str(tmp_path / "run"), "7.batch.0", node="n1")
    for i in range(1000):
        m.count("slurmckpt_captures_total", f"job-chose-{i}")
        m.count("slurmckpt_commits_total", f"job-chose-{i}")
        m.count("slurmckpt_capture_failures_total", f"x{i}")
    m.count("slurmckpt_captures_total", "interval")
    for i in range(MAX_LABEL_VALUES + 20):
        m.count("slurmckpt_policy_refusals_total", f"partition p{i}")
    s = samples((tmp_path / "m.prom").read_text())
    assert s[("slurmckpt_captures_total", (("trigger", "other"),))] == 1000
    assert s[("slurmckpt_captures_total", (("trigger", "interval"),))] == 1
    assert s[("slurmckpt_capture_failures_total", (("stage", "other"),))] == 1000
    assert s[("slurmckpt_policy_refusals_total", (("rule", "other"),))] == 20
    assert len([k for k in s if k[0] == "slurmckpt_policy_refusals_total"]) == MAX_LABEL_VALUES + 1
    assert len(s) < 80, len(s)
    assert (tmp_path / "run" / "metrics-n1.json").stat().st_size < 8192


@pytest.mark.parametrize("content", [
    b"{" + b'"counters": {"slurmckpt_captures_total": {' + b",".join(b'"t%d": 1' % i for i in range(400000)) + b"}}}",
    b"[" * 100000, b"not json", b'{"counters": 5, "gauges": {"slurmckpt_agents": {"t": {"value": "x"}}}}',
    b'{"counters": {"slurmckpt_captures_total": {"interval": "NaN"}, "nope": {}}, "histograms": '
    b'{"slurmckpt_stall_seconds": {"buckets": [1], "sum": 0, "count": 1}}}'])
def test_a_state_the_agents_cannot_read_back_starts_afresh_instead_of_stopping_the_nodes_metrics(tmp_path, content):
    """A state an earlier release let grow past 4 MiB (read cut there: not JSON any more), or one that is
    not JSON or not shaped as written, used to make every agent of the node fail its update, for good. The
    next update now starts from what can be kept (or from nothing) and the file is written again."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics-n1.json").write_bytes(content)
    m = NodeMetrics(str(tmp_path / "m.prom"), str(tmp_path / "run"), "7.batch.0", node="n1")
    m.count("slurmckpt_captures_total", "interval")
    m.count("slurmckpt_captures_total", "interval")
    s = samples((tmp_path / "m.prom").read_text())
    assert s[("slurmckpt_captures_total", (("trigger", "interval"),))] == 2
    assert (tmp_path / "run" / "metrics-n1.json").stat().st_size < 8192
    assert read_state(str(tmp_path / "run"), "n1")["counters"]["slurmckpt_captures_total"]["interval"] == 2


def test_the_fixed_label_sets_name_every_stage_phase_and_trigger_there_is():
    """The stage and trigger sets are written out here (metrics.py imports no rank module): each stage of the
    rank's tables, each phase the agent runs and each stage the coordinator names, and each trigger the
    wrapper, the coordinator and the schedule start an epoch with, is one of them."""
    import re
    from slurmckpt.agent.epochs import PHASE_OPS
    from slurmckpt.rank.capture import FINAL_CAPTURE, PERSIST, PREPARE
    from slurmckpt.agent.metrics import STAGES
    from slurmckpt.coordinator.protocol import TRIGGERS
    src = Path(__file__).resolve().parents[3] / "src" / "slurmckpt"
    named = set(re.findall(r'stage="([a-z-]+)"', (src / "coordinator" / "server.py").read_text()))
    assert named and {*PREPARE.names, *FINAL_CAPTURE.names, *PERSIST.names} | set(PHASE_OPS) | named <= set(STAGES)
    started = set(re.findall(r'(?:self\.trigger|self\.epoch)\("([a-z-]+)"', (src / "task" / "wrapper.py").read_text()
                             + (src / "coordinator" / "host.py").read_text()))
    started |= set(re.findall(r'\[\("([a-z-]+)", True\)\]', (src / "task" / "schedule.py").read_text()))
    assert started == set(TRIGGERS), started
