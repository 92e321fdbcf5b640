"""Loopback TCP between ranks held across separate restores (netlock.py): rules, protocol, detection."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slurmckpt.rank.sharing import netlock
from slurmckpt.rank.sharing import rendezvous
from slurmckpt.rank.sharing.rendezvous import RestoreKey
from slurmckpt.node.packet_filter import Iptables, Nftables

A, B = "127.0.0.1:40000", "127.0.0.1:50000"
TAG = "slurmckpt job 7"
KEY = RestoreKey(1, 0, 1, 1)


class FakeIptables:
    def __init__(self) -> None:
        self.rules: list[tuple[str, str]] = []      # (command, rule spec)
        self.calls: list[str] = []

    def __call__(self, cmd: list[str], stdin: str) -> None:
        self.calls.append(cmd[0])
        for line in stdin.splitlines():
            if line.startswith("-I "):
                self.rules.append((cmd[0], line[3:]))
            elif line.startswith("-D "):
                if (cmd[0], line[3:]) not in self.rules:
                    raise OSError("Bad rule (does a matching rule exist in that chain?)")
                self.rules.remove((cmd[0], line[3:]))


def test_rules_drop_both_directions_and_let_criu_repair_traffic_through() -> None:
    drops = netlock.drops(A, B)
    assert [Iptables.spec(d, TAG) for d in drops] == [
        'OUTPUT -p tcp -s 127.0.0.1 --sport 40000 -d 127.0.0.1 --dport 50000 -m mark ! --mark 0xC114 '
        '-m comment --comment "slurmckpt job 7" -j DROP',
        'OUTPUT -p tcp -s 127.0.0.1 --sport 50000 -d 127.0.0.1 --dport 40000 -m mark ! --mark 0xC114 '
        '-m comment --comment "slurmckpt job 7" -j DROP']
    assert [Nftables.rule(d, TAG) for d in drops][0] == (
        'ip saddr 127.0.0.1 tcp sport 40000 ip daddr 127.0.0.1 tcp dport 50000 meta mark != 0xc114 counter drop '
        'comment "slurmckpt job 7"')
    assert {d.version for d in netlock.drops("[::1]:1", "[::1]:2")} == {6}
    assert Nftables.rule(netlock.drops("[::1]:1", "[::1]:2")[0], TAG).startswith("ip6 saddr ::1 tcp sport 1 ")
    assert netlock.pair_id(A, B) == netlock.pair_id(B, A)


@pytest.mark.parametrize("order", ["nested", "sequential"])
def test_first_rank_locks_both_ends_and_the_last_one_back_unlocks(tmp_path: Path, order: str) -> None:
    ipt = FakeIptables()
    hold = lambda local, remote: netlock.hold_during_restore([[local, remote]], RestoreKey(7, 0, 3, 1), TAG, Iptables(ipt), tmp_path)
    if order == "nested":       # B starts while A is being restored, finishes after it
        with hold(A, B):
            assert len(ipt.rules) == 2
            with hold(B, A):
                assert len(ipt.rules) == 2          # not added twice
            assert len(ipt.rules) == 2
    else:                       # A restored and running long before B starts
        with hold(A, B):
            pass
        assert len(ipt.rules) == 2, "A's packets to the missing B must stay dropped, not reset"
        with hold(B, A):
            assert len(ipt.rules) == 2
    assert ipt.rules == [] and not list(tmp_path.glob("7.0.3.*"))


def test_a_failed_restore_still_counts_so_the_peer_is_not_held_forever(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], RestoreKey(7, 0, 3, 1), TAG, Iptables(ipt), tmp_path):
        pass
    with pytest.raises(RuntimeError):
        with netlock.hold_during_restore([[B, A]], RestoreKey(7, 0, 3, 1), TAG, Iptables(ipt), tmp_path):
            raise RuntimeError("criu restore failed")
    assert ipt.rules == []


def test_rules_already_gone_are_deleted_one_by_one(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], KEY, TAG, Iptables(ipt), tmp_path):
        pass
    ipt.rules.pop()              # someone removed one rule by hand
    with netlock.hold_during_restore([[B, A]], KEY, TAG, Iptables(ipt), tmp_path):
        pass
    assert ipt.rules == []


def test_ipv6_connections_use_ip6tables_and_nothing_runs_without_connections(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([], KEY, TAG, Iptables(ipt), tmp_path):
        pass
    assert ipt.calls == []
    with netlock.hold_during_restore([["[::1]:1", "[::1]:2"]], KEY, TAG, Iptables(ipt), tmp_path):
        assert {c for c, _ in ipt.rules} == {"ip6tables-restore"}


def test_internal_connections_finds_loopback_tcp_to_another_tree_only() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = subprocess.Popen([sys.executable, "-c", f"import socket, time\ns = socket.create_connection("
                               f"('127.0.0.1', {port}))\nprint(s.getsockname()[1], flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        cport = int(client.stdout.readline())
        conn, _ = listener.accept()
        server = subprocess.Popen([sys.executable, "-c", "import time; print('ok', flush=True); time.sleep(60)"],
                                  pass_fds=[conn.fileno()], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ok"
            conn.close()
            found = netlock.internal_connections([client.pid], {server.pid: ("0", 1)})
            assert found == [(f"127.0.0.1:{cport}", f"127.0.0.1:{port}", "0", 1)]
            assert netlock.internal_connections([client.pid], {}) == []
            assert netlock.internal_connections([client.pid, server.pid], {}) == [], \
                "both ends in one tree: one criu restore brings them back together"
            assert netlock.still_established([client.pid], found) == [list(found[0])]
            assert netlock.still_established([server.pid], found) == []
        finally:
            server.kill(), server.wait()
    finally:
        client.kill(), client.wait()
        listener.close()


def test_only_connections_both_ranks_recorded_are_held() -> None:
    records = {("0", 1): {"tcp_ranks": [[B, A, "0", 0]]}, ("1", 0): {"tcp_ranks": []}}

    def read(step: str, rank: int) -> dict:
        return records[(step, rank)]          # KeyError: that rank has no record in this epoch

    entries = [[A, B, "0", 1],                            # mirrored in rank 1's record: held
               ["127.0.0.1:1", "127.0.0.1:2", "1", 0],    # the peer no longer had it at its capture
               ["127.0.0.1:3", "127.0.0.1:4", "2", 5]]    # no record for that rank at all
    assert netlock.confirmed(entries, "0", 0, read) == [[A, B]]
    assert netlock.confirmed(entries, "0", 7, read) == []     # the mirrored entry names another rank


def test_restore_key_is_per_network_namespace() -> None:
    import os
    key = rendezvous.restore_key(7, 1, 3)
    assert str(key) == f"7.1.3.{os.stat('/proc/self/ns/net').st_ino}"
    assert RestoreKey.parse(f"{key}.127.0.0.1_5-127.0.0.1_6") == key and RestoreKey.parse("7.1.x.4") is None


def test_a_hold_left_by_an_earlier_attempt_is_lifted_by_the_next_one(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], RestoreKey(7, 0, 3, 1), TAG, Iptables(ipt), tmp_path):
        pass                                 # restart 0: rank 1 never came (job requeued)
    with netlock.hold_during_restore([["127.0.0.1:9", "127.0.0.1:8"]], RestoreKey(8, 0, 3, 1), TAG, Iptables(ipt), tmp_path):
        pass                                 # another job's hold stays
    assert len(ipt.rules) == 4
    with netlock.hold_during_restore([[A, B]], RestoreKey(7, 1, 2, 1), TAG, Iptables(ipt), tmp_path):
        assert len(ipt.rules) == 4           # restart 1 lifted restart 0's, added its own
    assert len(ipt.rules) == 4 and len(list(tmp_path.glob("7.1.*"))) == 1 and not list(tmp_path.glob("7.0.*"))


def test_one_verdict_per_restore_is_reached_without_the_node_lock(tmp_path: Path) -> None:
    """The first rank of a restore does the work on the user's path; the node-wide lock stays free for every
    other restore meanwhile, the other ranks of the same restore wait for the verdict, and a verdict that
    does not come is a bounded wait, never a hang."""
    import threading
    import time
    release = threading.Event()
    results: dict[str, tuple[str, bool]] = {}

    def slow() -> str:
        release.wait(10)
        return "ok"
    first = threading.Thread(target=lambda: results.update(first=rendezvous.first_on_node(tmp_path / "k.shm.a", slow, 5)))
    first.start()
    while not (tmp_path / "k.shm.a").exists():
        time.sleep(0.01)
    took = time.monotonic()
    with rendezvous.node_lock(tmp_path):
        took = time.monotonic() - took
    assert took < 1, "the node-wide lock was held around the work"
    assert rendezvous.first_on_node(tmp_path / "k.shm.a", slow, 0.2) == \
        ("the rank restored first on this node gave no verdict within 0s", False)
    second = threading.Thread(target=lambda: results.update(second=rendezvous.first_on_node(tmp_path / "k.shm.a", slow, 5)))
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert results == {"first": ("ok", True), "second": ("ok", False)}

    def failing() -> str:
        raise OSError("No such device or address")
    with pytest.raises(OSError):
        rendezvous.first_on_node(tmp_path / "k.file.b", failing, 1)
    verdict, ran = rendezvous.first_on_node(tmp_path / "k.file.b", failing, 1)
    assert not ran and verdict.startswith("failed on the rank restored first on this node: ")
