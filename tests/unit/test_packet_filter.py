"""The node's packet filter (packet_filter.py): iptables where installed, else nftables through libnftables;
each hold lifted exactly."""
from __future__ import annotations

from pathlib import Path

from slurmckpt.node import packet_filter
from slurmckpt.node.packet_filter import Drop, Nftables

TAG = "slurmckpt job 7"
DROPS = [Drop("10.77.0.1", 40000, "10.77.0.2", 5000), Drop("10.77.0.2", 5000, "10.77.0.1", 40000)]


def test_a_hold_is_a_chain_of_its_own_and_lifting_deletes_that_chain():
    scripts: list[str] = []
    nft = Nftables(scripts.append)
    nft.hold(DROPS, TAG)
    nft.lift(list(reversed(DROPS)), TAG)         # the same hold, whatever the order it is named in
    held, lifted = scripts
    chain = Nftables.chain(DROPS, TAG)
    assert f"add chain inet slurmckpt {chain} {{ type filter hook output priority -10 ; policy accept ; }}" in held
    assert held.count("add rule inet slurmckpt " + chain) == 2
    assert "ip saddr 10.77.0.1 tcp sport 40000 ip daddr 10.77.0.2 tcp dport 5000 meta mark != 0xc114" in held
    assert lifted == f"flush chain inet slurmckpt {chain}\ndelete chain inet slurmckpt {chain}\n"
    assert Nftables.chain(DROPS, "slurmckpt job 8") != chain and Nftables.chain(DROPS[:1], TAG) != chain


def test_a_tag_cannot_break_out_of_its_comment():
    rule = Nftables.rule(DROPS[0], 'job 7" ; add rule inet filter input accept ; "')
    assert rule.endswith('comment "job 7\\" ; add rule inet filter input accept ; \\""')


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
