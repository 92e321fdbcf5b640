"""The root agent's reading of a partition's interruptions for --checkpoint-interval=auto (interruptions.py):
sacct's answer parsed (fake Slurm), tallied over node time and weighed with the site's value, the node cache
that answers at once and refreshes in the background (fake clock), and the config keys that steer it."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from fake_slurm import FakeSlurm
from slurmckpt.agent import interruptions
from slurmckpt.config import Config
from slurmckpt.errors import ConfigError, SlurmError
from slurmckpt.agent.interruptions import History, PartitionHistory, answer, tally
from slurmckpt.slurm.control import CliSlurm


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

# ---- accounting, as the root agent reads it ----------------------------------------------------------------
SACCT = ("COMPLETED|3600|1\nNODE_FAIL|1800|2\nPREEMPTED|600|1\nREQUEUED|100|1\nCANCELLED by 1001|50|1\n"
         "garbage line\nRUNNING|x|1\n")


def test_partition_runs_asks_sacct_for_three_fields_of_every_run(monkeypatch):
    fake = FakeSlurm(sacct=SACCT).install(monkeypatch)
    runs = CliSlurm().partition_runs("low", 604800)
    assert runs == [("COMPLETED", 3600, 1), ("NODE_FAIL", 1800, 2), ("PREEMPTED", 600, 1), ("REQUEUED", 100, 1),
                    ("CANCELLED", 50, 1)]
    cmd = fake.ran("sacct")[0]
    assert cmd == ["sacct", "-a", "-X", "-D", "-n", "-P", "-r", "low", "-S", "now-604800", "-E", "now", "-o",
                   "State,ElapsedRaw,NNodes"]


def test_tally_counts_the_configured_states_over_node_time_and_weighs_the_prior():
    runs = [("COMPLETED", 3600, 1), ("NODE_FAIL", 1800, 2), ("PREEMPTED", 600, 1), ("REQUEUED", 100, 1)]
    h = tally("low", runs, ("NODE_FAIL", "PREEMPTED"), 604800, 5.0)
    assert (h.interruptions, h.node_s, h.runs) == (2, 3600 + 3600 + 600 + 100, 4)
    assert h.node_mtbi(86400) == pytest.approx((7900 + 86400) / 3)
    empty = tally("low", [], ("NODE_FAIL",), 604800, 5.0)
    assert empty.node_mtbi(86400) == 86400                 # no history: the site's value
    calm = tally("low", [("COMPLETED", 1000 * 3600, 1)], ("NODE_FAIL",), 604800, 5.0)
    assert calm.node_mtbi(86400) == 1000 * 3600 + 86400     # a long calm history lengthens M
    busy = tally("low", [("NODE_FAIL", 360, 1)] * 1000, ("NODE_FAIL",), 604800, 5.0)
    assert busy.node_mtbi(86400) == pytest.approx((360000 + 86400) / 1001)    # much history: what it saw


def test_answer_divides_by_the_job_nodes_and_says_its_source():
    h = History("low", 1, 7200.0, 3, 604800, 5.0)
    got = answer(h, False, 3600, 4, 604800)
    assert got["source"] == "accounting" and got["node_mtbi_s"] == 5400 and got["mtbi_s"] == 1350
    assert answer(None, True, 3600, 2, 604800) == {"prior_s": 3600, "nodes": 2, "window_s": 604800,
                                                   "source": "pending", "node_mtbi_s": 3600, "mtbi_s": 1800}
    failed = answer(History("low", 0, 0.0, 0, 604800, 5.0, error="sacct: timeout"), False, 3600, 1, 604800)
    assert failed["source"] == "default" and failed["error"] == "sacct: timeout" and failed["mtbi_s"] == 3600


def wait_for(history: PartitionHistory) -> None:
    if history._thread:
        history._thread.join(10)


def test_the_node_cache_answers_at_once_refreshes_in_the_background_and_caches_failures(tmp_path: Path):
    clock, asked = Clock(), []
    gate, entered = threading.Event(), threading.Event()

    def query(partition: str, window: int):
        asked.append((partition, window))
        entered.set()
        gate.wait(5)
        return [("NODE_FAIL", 3600, 1), ("COMPLETED", 3600, 1)]
    h = PartitionHistory(tmp_path / "int", "c", "low", 86400, ("NODE_FAIL",), query, clock)
    assert h.current() == (None, True)           # nothing cached: the refresh runs, nobody waits for it
    assert entered.wait(5)
    assert h.current() == (None, True) and len(asked) == 1      # one refresh at a time
    gate.set()
    wait_for(h)
    cached, pending = h.current()
    assert not pending and (cached.interruptions, cached.node_s) == (1, 7200.0) and len(asked) == 1
    assert oct(os.stat(tmp_path / "int").st_mode & 0o777) == "0o700"
    other = PartitionHistory(tmp_path / "int", "c", "low", 86400, ("NODE_FAIL",), query, clock)
    assert other.current()[0] == cached and len(asked) == 1       # another agent on the node: the cache
    clock.now += interruptions.CACHE_S + 1
    stale, pending = h.current()                 # stale: served while the refresh runs
    assert stale == cached and pending
    wait_for(h)
    assert len(asked) == 2

    def broken(partition: str, window: int):
        asked.append("broken")
        raise SlurmError("sacct: slurmdbd not responding")
    b = PartitionHistory(tmp_path / "int", "c", "high", 86400, ("NODE_FAIL",), broken, clock)
    b.current()
    wait_for(b)
    failed, pending = b.current()
    assert failed.error.startswith("sacct") and not pending and asked.count("broken") == 1
    clock.now += interruptions.FAILED_CACHE_S + 1
    assert b.current()[1]                       # retried after ten minutes, not an hour


def test_no_window_no_partition_or_an_odd_name_asks_nothing(tmp_path: Path):
    def query(partition: str, window: int):
        raise AssertionError("asked")
    for window, partition in ((0, "low"), (86400, ""), (86400, "../etc"), (86400, "a b")):
        assert PartitionHistory(tmp_path, "c", partition, window, ("NODE_FAIL",), query).current() == (None, False)


def test_another_agent_refreshing_is_not_waited_for(tmp_path: Path):
    import fcntl
    h = PartitionHistory(tmp_path / "int", "c", "low", 86400, ("NODE_FAIL",), lambda p, w: [])
    (tmp_path / "int").mkdir()
    held = os.open(tmp_path / "int" / "c.low.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert h.refresh() is None and not (tmp_path / "int" / "c.low.json").exists()
    finally:
        os.close(held)
    assert h.refresh() is not None and (tmp_path / "int" / "c.low.json").exists()


# ---- the config's keys -------------------------------------------------------------------------------------
def test_config_durations_and_states():
    c = Config.from_mapping({"auto_first_interval": "2m", "interruption_mtbi": "12h", "interruption_window": False,
                             "interruption_states": "NODE_FAIL PREEMPTED REQUEUED"})
    assert (c.auto_first_interval, c.interruption_mtbi, c.interruption_window) == (120, 43200, 0)
    assert c.interruption_states == ("NODE_FAIL", "PREEMPTED", "REQUEUED")
    assert (Config().auto_first_interval, Config().interruption_mtbi, Config().interruption_window) == \
        (600, 86400, 7 * 86400)
    for raw, message in (({"auto_first_interval": "off"}, "must be a duration, not off"),
                         ({"interruption_mtbi": "5x"}, "key 'interruption_mtbi': bad value '5x'"),
                         ({"interruption_states": "node_fail"}, "key 'interruption_states': bad value 'node_fail'")):
        with pytest.raises(ConfigError, match=message):
            Config.from_mapping(raw)
