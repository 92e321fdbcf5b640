"""The node's packet filter (packet_filter.py): iptables where installed, else nftables through libnftables;
one rule set per job, changed in one batch whatever the number of connections, capped, lifted whole."""
from __future__ import annotations

from pathlib import Path

import pytest

from fake_filters import FakeIptables, FakeNftables
from slurmckpt.errors import RestoreError
from slurmckpt.node import packet_filter
from slurmckpt.node.packet_filter import Drop, Iptables, Nftables

DROPS = [Drop("10.77.0.1", 40000, "10.77.0.2", 5000), Drop("10.77.0.2", 5000, "10.77.0.1", 40000)]


def many(n: int, first_port: int = 20000) -> list[Drop]:
    return [Drop("127.0.0.1", first_port + i, "127.0.0.1", 5000) for i in range(n)]


def test_an_iptables_hold_is_the_jobs_own_chain_changed_in_one_batch_per_ip_version():
    ipt = FakeIptables()
    packet_filter.update(ipt.filter(), 7, many(3000), cap=2000)
    assert [c[0] for c in ipt.calls] == ["iptables", "ip6tables", "iptables-restore"], \
        "3000 connections: one look and one batch, not one call per connection"
    assert ipt.job_chains() == ["SLURMCKPT-7"] and len(ipt.rules(7)) == 3001        # its rules and one jump
    assert ipt.chains[4]["OUTPUT"] == ['-p tcp -m comment --comment "slurmckpt job 7" -j SLURMCKPT-7']
    assert all('--comment "slurmckpt job 7"' in r for r in ipt.rules(7))
    ipt.calls.clear()
    packet_filter.update(ipt.filter(), 7, remove=many(2999))
    assert [c[0] for c in ipt.calls] == ["iptables", "ip6tables", "iptables-restore"]
    assert packet_filter.update(ipt.filter(), 7, remove=many(3000)) == 0
    assert ipt.job_chains() == [] and ipt.rules() == [], "the last rule takes the chain and its jump with it"


def test_an_nftables_hold_is_one_table_per_job_with_sets_and_one_base_chain():
    nft = FakeNftables()
    packet_filter.update(nft.filter(), 7, many(3000) + [Drop("::1", 1, "::1", 2)], cap=2000)
    assert len(nft.calls) == 2, "one look, one transaction"
    assert list(nft.tables) == ["slurmckpt-7"] and nft.tables["slurmckpt-7"]["chain"] is True
    assert len(nft.elements(7)) == 3001 and "::1 . 1 . ::1 . 2" in nft.elements(7)
    script = nft.calls[1]
    assert "add chain inet slurmckpt-7 hold { type filter hook output priority -10 ; policy accept ; }" in script
    assert ("add rule inet slurmckpt-7 hold meta mark != 0xc114 ip saddr . tcp sport . ip daddr . tcp dport @v4 "
            'counter drop comment "slurmckpt job 7"') in script
    packet_filter.update(nft.filter(), 8, DROPS, cap=10)
    assert packet_filter.lift_job(nft.filter(), 7) == 3001
    assert list(nft.tables) == ["slurmckpt-8"], "another job's set is its own"


def test_lifting_a_rule_already_gone_is_no_error():
    for fake in (FakeIptables(), FakeNftables()):
        packets = fake.filter()
        packet_filter.update(packets, 7, DROPS)
        assert packet_filter.update(packets, 7, remove=[DROPS[0], Drop("10.0.0.1", 1, "10.0.0.2", 2)]) == 1
        assert packet_filter.update(packets, 7, remove=DROPS) == 0
        assert packet_filter.lift_job(packets, 7) == 0 and packet_filter.lift_job(packets, 99) == 0


def test_a_hold_above_the_cap_is_refused_before_anything_changes():
    """A connection between two ranks of the node takes two rules: the cap (connections) allows 2 x cap."""
    for fake in (FakeIptables(), FakeNftables()):
        packets = fake.filter()
        packet_filter.update(packets, 7, many(8), cap=4)
        with pytest.raises(RestoreError, match=r"would hold 9 TCP rules .* above 2 x tcp_hold_max \(4 conn"):
            packet_filter.update(packets, 7, many(1, 30000), cap=4)
        assert packet_filter.update(packets, 7, many(1, 30000), remove=many(1), cap=4) == 8     # a swap fits
        assert packet_filter.update(packets, 7, remove=many(1, 30000), cap=4) == 7             # lifting always does


def test_the_jobs_with_rules_are_listed_by_their_chains_and_tables():
    ipt, nft = FakeIptables(), FakeNftables()
    for job in (7, 12):
        packet_filter.update(ipt.filter(), job, DROPS)
        packet_filter.update(nft.filter(), job, DROPS)
    assert ipt.filter().jobs() == nft.filter().jobs() == {7, 12}


def test_a_chain_whose_jump_was_removed_by_hand_still_goes():
    ipt = FakeIptables()
    packet_filter.update(ipt.filter(), 7, DROPS)
    ipt.chains[4]["OUTPUT"].clear()
    assert packet_filter.lift_job(ipt.filter(), 7) == 2 and ipt.job_chains() == []


def test_a_rule_carries_the_job_and_lets_criu_repair_traffic_through():
    assert Iptables.spec(DROPS[0], 7) == ('-p tcp -s 10.77.0.1 --sport 40000 -d 10.77.0.2 --dport 5000 -m mark ! '
                                          '--mark 0xC114 -m comment --comment "slurmckpt job 7" -j DROP')
    assert Nftables.element(Drop("::1", 1, "::2", 2)) == "::1 . 1 . ::2 . 2"


def test_auto_picks_iptables_where_installed_else_nftables(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(packet_filter, "PATH", str(tmp_path))
    assert packet_filter.method("auto") == "nftables"          # a GPU image without iptables
    tool = tmp_path / "iptables-restore"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert packet_filter.method("auto") == "iptables"
    assert packet_filter.method("nftables") == "nftables"      # a site's choice stands
    assert packet_filter.for_method("nftables").name == "nftables"
    assert packet_filter.for_method("iptables").name == "iptables"


def test_drops_round_trip_through_a_marker_and_refuse_what_is_not_an_address():
    assert [Drop.from_list(d.to_list()) for d in DROPS] == DROPS
    try:
        Drop.from_list(["10.77.0.1; flush ruleset", 1, "10.77.0.2", 2])
    except ValueError:
        pass
    else:
        raise AssertionError("a marker's address reached a rule unchecked")


def test_doctor_says_which_packet_filter_holds_tcp_here(monkeypatch, tmp_path: Path):
    from slurmckpt.cli.doctor import Report, check_network_lock
    from slurmckpt.config import Config
    monkeypatch.setattr(packet_filter, "PATH", str(tmp_path))           # a node without iptables
    monkeypatch.setattr(packet_filter, "has_libnftables", lambda: True)
    r = Report()
    check_network_lock(r, Config())
    monkeypatch.setattr(packet_filter, "has_libnftables", lambda: False)
    check_network_lock(r, Config())
    check_network_lock(r, Config(network_lock="iptables"))
    assert [(row["result"], row["detail"]) for row in r.rows] == [
        ("ok", "nftables through libnftables (no iptables here)"),
        ("FAIL", "nftables through libnftables (no iptables here): libnftables.so.1 is missing, so no TCP "
                 "connection can be held (install libnftables1 or iptables)"),
        ("FAIL", "iptables (network_lock: iptables): iptables-restore is missing")]
