"""TCP between ranks on two nodes of the job: which connections are the job's, the refusal on a node without
the recorded addresses, and the hold each end keeps (its OUTPUT rule) until the other end says it is back."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurmckpt.rank.sharing import crossnode
from slurmckpt.errors import RestoreError
from fake_filters import FakeIptables
from slurmckpt.node.proctree import TcpConnection

A, B = "10.77.0.1:40000", "10.77.0.2:5000"


def test_only_connections_to_the_jobs_other_nodes_are_the_jobs() -> None:
    outside = [TcpConnection(A, B, "10.77.0.2", 11, False),
               TcpConnection("10.77.0.1:40001", "10.0.0.9:5432", "10.0.0.9", 12, False)]   # a database
    assert crossnode.job_connections(outside, {"10.77.0.2", "10.77.0.3"}) == [[A, B]]
    assert crossnode.job_connections(outside, set()) == []


def test_a_node_without_the_recorded_address_refuses_before_criu_runs() -> None:
    crossnode.require_local_addresses([[A, B]], {"10.77.0.1", "127.0.0.1"}, "node1")
    with pytest.raises(RestoreError, match=r"10\.77\.0\.1 \(node node1 at the capture\).*original nodes"):
        crossnode.require_local_addresses([[A, B]], {"10.77.0.3", "127.0.0.1"}, "node1")


def hold(entries: list[list[str]], tmp_path: Path, rules: FakeIptables, **kw: float) -> crossnode.Hold:
    return crossnode.Hold(entries, tmp_path / "sync", "1.4", 7, rules.filter(), 1024, lock_dir=tmp_path / "locks", **kw)


def test_each_end_holds_its_packets_until_the_other_end_is_back(tmp_path: Path) -> None:
    """Node 1 restores first: its rule stays while node 2 is not back, and goes once node 2 has said it is;
    node 2, restored second, finds node 1's word at once."""
    node1, node2 = FakeIptables(), FakeIptables()
    end1 = hold([[A, B]], tmp_path, node1, timeout_s=30, poll_s=0.01)
    end2 = hold([[B, A]], tmp_path, node2, timeout_s=30, poll_s=0.01)
    end1.before_restore()
    assert len(node1.rules(7)) == 2 and "-s 10.77.0.1 --sport 40000 -d 10.77.0.2 --dport 5000" in node1.rules(7)[1]
    end1.after_restore()
    time.sleep(0.2)
    assert len(node1.rules(7)) == 2, "lifted before the other end was back"
    end2.before_restore()
    end2.after_restore()
    for end in (end1, end2):
        end.thread.join(5)
    assert node1.rules() == [] and node2.rules() == []


def test_an_end_that_never_comes_back_lifts_the_hold_after_the_timeout(tmp_path: Path) -> None:
    rules = FakeIptables()
    end = hold([[A, B]], tmp_path, rules, timeout_s=0.2, poll_s=0.01)
    end.before_restore()
    end.after_restore()
    end.thread.join(5)
    assert rules.rules() == []


def test_a_failed_restore_lifts_its_rules(tmp_path: Path) -> None:
    rules = FakeIptables()
    end = hold([[A, B]], tmp_path, rules)
    end.before_restore()
    end.release()
    assert rules.rules() == [] and not (tmp_path / "sync").exists(), "nothing may say this end is back"


def test_many_ends_are_held_in_one_batch_and_above_the_cap_refused(tmp_path: Path) -> None:
    rules = FakeIptables()
    entries = [[f"10.77.0.1:{40000 + i}", B] for i in range(2000)]
    end = hold(entries, tmp_path, rules)
    end.before_restore()
    assert [c[0] for c in rules.calls] == ["iptables", "ip6tables", "iptables-restore"]
    assert len(rules.filter().held(7).drops) == 2000
    end.release()
    refused = crossnode.Hold(entries, tmp_path / "sync", "1.4", 7, rules.filter(), 999, lock_dir=tmp_path / "locks")
    with pytest.raises(RestoreError, match=r"2000 TCP rules .* tcp_hold_max \(999 connections\)"):
        refused.before_restore()
    assert rules.rules() == [] and refused.held == {}


def test_connections_are_closed_or_held_as_the_check_sorted_them_never_by_what_is_left_at_the_dump(monkeypatch):
    """In a final capture another rank's dump may already have ended its tree when this rank records its
    connections: a connection to that rank then looks like one to outside the job. Only what the check
    (all trees running) sorted as outside is restored closed; a connection it did not sort is kept."""
    from types import SimpleNamespace

    from slurmckpt.rank import checks as capture_checks
    from slurmckpt.node import proctree
    client = TcpConnection("10.77.0.1:8000", "10.0.0.9:51000", "10.0.0.9", 21, True)
    other_node = TcpConnection(A, B, "10.77.0.2", 22, False)
    same_node_rank = TcpConnection("10.77.0.1:40002", "10.77.0.1:5001", "10.77.0.1", 23, False)  # peer just died
    monkeypatch.setattr(proctree, "outside_tcp", lambda pids, inside=frozenset(): [client, other_node, same_node_rank])
    p = SimpleNamespace(tcp_outside={21: False, 22: True, 99: False})     # 99: closed since the check
    assert capture_checks.tcp_leaving_the_node(p, [1]) == (((A, B),), (21,))
