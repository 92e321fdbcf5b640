"""Loopback TCP between ranks held across separate restores (netlock.py): rules, protocol, detection, the
job's lock, the cap, and what the job's end lifts."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fake_filters import FakeIptables, FakeNftables
from slurmckpt.errors import RestoreError
from slurmckpt.rank.sharing import netlock
from slurmckpt.rank.sharing import rendezvous
from slurmckpt.rank.sharing.rendezvous import RestoreKey
from slurmckpt.node.packet_filter import Iptables

A, B = "127.0.0.1:40000", "127.0.0.1:50000"
KEY = RestoreKey(1, 0, 1, 1)
CAP = 1024


def held(ipt: FakeIptables, job: int = 7) -> int:
    return len(ipt.filter().held(job).drops)


def pairs(n: int) -> list[list[str]]:
    return [[f"127.0.0.1:{20000 + i}", "127.0.0.1:5000"] for i in range(n)]


def test_rules_drop_both_directions_and_let_criu_repair_traffic_through() -> None:
    drops = netlock.drops(A, B)
    assert [Iptables.spec(d, 7) for d in drops] == [
        '-p tcp -s 127.0.0.1 --sport 40000 -d 127.0.0.1 --dport 50000 -m mark ! --mark 0xC114 '
        '-m comment --comment "slurmckpt job 7" -j DROP',
        '-p tcp -s 127.0.0.1 --sport 50000 -d 127.0.0.1 --dport 40000 -m mark ! --mark 0xC114 '
        '-m comment --comment "slurmckpt job 7" -j DROP']
    assert {d.version for d in netlock.drops("[::1]:1", "[::1]:2")} == {6}
    assert netlock.pair_id(A, B) == netlock.pair_id(B, A)


@pytest.mark.parametrize("order", ["nested", "sequential"])
def test_first_rank_locks_both_ends_and_the_last_one_back_unlocks(tmp_path: Path, order: str) -> None:
    ipt = FakeIptables()
    hold = lambda local, remote: netlock.hold_during_restore([[local, remote]], RestoreKey(7, 0, 3, 1), ipt.filter(), CAP, tmp_path)
    if order == "nested":       # B starts while A is being restored, finishes after it
        with hold(A, B):
            assert held(ipt) == 2
            with hold(B, A):
                assert held(ipt) == 2          # not added twice
            assert held(ipt) == 2
    else:                       # A restored and running long before B starts
        with hold(A, B):
            pass
        assert held(ipt) == 2, "A's packets to the missing B must stay dropped, not reset"
        with hold(B, A):
            assert held(ipt) == 2
    assert ipt.rules() == [] and ipt.job_chains() == [] and not list(tmp_path.glob("7.0.3.*"))


def test_a_failed_restore_still_counts_so_the_peer_is_not_held_forever(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], RestoreKey(7, 0, 3, 1), ipt.filter(), CAP, tmp_path):
        pass
    with pytest.raises(RuntimeError):
        with netlock.hold_during_restore([[B, A]], RestoreKey(7, 0, 3, 1), ipt.filter(), CAP, tmp_path):
            raise RuntimeError("criu restore failed")
    assert ipt.rules() == []


def test_rules_already_gone_are_no_error(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], KEY, ipt.filter(), CAP, tmp_path):
        pass
    ipt.chains[4]["SLURMCKPT-1"].pop()              # someone removed one rule by hand
    with netlock.hold_during_restore([[B, A]], KEY, ipt.filter(), CAP, tmp_path):
        pass
    assert ipt.rules() == []


def test_ipv6_connections_use_ip6tables_and_nothing_runs_without_connections(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([], KEY, ipt.filter(), CAP, tmp_path):
        pass
    assert ipt.calls == []
    with netlock.hold_during_restore([["[::1]:1", "[::1]:2"]], KEY, ipt.filter(), CAP, tmp_path):
        assert list(ipt.chains[6]) == ["OUTPUT", "SLURMCKPT-1"] and list(ipt.chains[4]) == ["OUTPUT"]


def test_thousands_of_connections_are_one_batch_and_no_other_job_waits_for_them(tmp_path: Path) -> None:
    """A rank with 3000 connections to another rank: one look and one batch at the hold, one each at the
    lift, whatever the count; meanwhile another job's restore takes its own lock and holds at once (it
    waited 11-14 s for a node-wide lock behind one packet filter call per connection)."""
    ipt = FakeIptables()
    slow = threading.Event()
    real = ipt.__call__

    def runner(cmd: list[str], stdin: str) -> str:
        if "--noflush" in cmd and "SLURMCKPT-7" in stdin:
            slow.wait(5)                    # job 7's batch takes long
        return real(cmd, stdin)
    packets = Iptables(runner)
    first = threading.Thread(target=lambda: netlock.hold_during_restore(
        pairs(3000), RestoreKey(7, 0, 3, 1), packets, 3000, tmp_path).__enter__())
    first.start()
    while not (tmp_path / ".lock-7").exists():
        time.sleep(0.01)
    t0 = time.monotonic()
    with netlock.hold_during_restore([[A, B]], RestoreKey(8, 0, 1, 1), packets, CAP, tmp_path):
        assert held(ipt, 8) == 2
    assert time.monotonic() - t0 < 2, "another job's restore waited for this one's hold"
    slow.set()
    first.join(5)
    assert held(ipt, 7) == 6000
    assert sum(1 for c in ipt.calls if c[0].endswith("restore")) == 2      # job 7's hold, job 8's
    ipt.calls.clear()
    with netlock.hold_during_restore([[b, a] for a, b in pairs(3000)], RestoreKey(7, 0, 3, 1), packets, 3000, tmp_path):
        pass
    assert [c[0] for c in ipt.calls] == ["iptables", "ip6tables", "iptables-restore"]
    assert held(ipt, 7) == 0 and ipt.job_chains() == ["SLURMCKPT-8"]


def test_more_connections_than_the_cap_are_refused_naming_both_and_hold_nothing(tmp_path: Path) -> None:
    nft = FakeNftables()
    with netlock.hold_during_restore(pairs(3), RestoreKey(7, 0, 3, 1), nft.filter(), 4, tmp_path):
        pass                                    # the other ends never come: 3 connections held
    with pytest.raises(RestoreError, match=r"would hold 10 TCP rules .*2 x tcp_hold_max \(4 connections\)"):
        with netlock.hold_during_restore(pairs(5)[3:], RestoreKey(7, 0, 3, 1), nft.filter(), 4, tmp_path):
            raise AssertionError("restored above the cap")
    assert len(nft.elements(7)) == 6 and len(json.loads(next(tmp_path.glob("7.0.3.*.tcp")).read_text())) == 3
    with pytest.raises(RestoreError):           # refused, yet this rank's end of a held connection counts
        with netlock.hold_during_restore([[b, a] for a, b in pairs(3)] + pairs(5)[3:], RestoreKey(7, 0, 3, 1),
                                         nft.filter(), 4, tmp_path):
            pass
    assert nft.tables == {} and not list(tmp_path.glob("7.*.tcp"))


def test_the_jobs_end_lifts_all_it_holds_here_in_every_filter_and_leaves_other_jobs(tmp_path: Path) -> None:
    """A job killed mid-restore: its first rank's holds stay (the other end never comes) until its end."""
    ipt, nft = FakeIptables(), FakeNftables()
    key = rendezvous.restore_key(7, 0, 3)
    with netlock.hold_during_restore(pairs(50), key, ipt.filter(), CAP, tmp_path):
        pass
    with netlock.hold_during_restore(pairs(2), key, nft.filter(), CAP, tmp_path / "other"):
        pass
    with netlock.hold_during_restore(pairs(2), RestoreKey(8, 0, 1, key.netns), ipt.filter(), CAP, tmp_path):
        pass
    elsewhere = tmp_path / f"7.0.3.{key.netns + 1}.tcp"          # another network namespace (a test cluster)
    elsewhere.write_text("{}")
    said = netlock.lift_job(7, [ipt.filter(), nft.filter()], tmp_path)
    assert said == ["iptables: 100 rule(s)", "nftables: 4 rule(s)"]
    assert held(ipt, 7) == 0 and nft.tables == {} and held(ipt, 8) == 4
    assert sorted(p.name for p in tmp_path.glob("7.*")) == [elsewhere.name] and list(tmp_path.glob("8.*"))
    assert netlock.lift_job(7, [ipt.filter()], tmp_path) == []


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
    records = {("0", 1): ((B, A, "0", 0),), ("1", 0): ()}

    def read(step: str, rank: int) -> tuple:
        return records[(step, rank)]          # KeyError: that rank has no record in this epoch

    entries = [(A, B, "0", 1),                            # mirrored in rank 1's record: held
               ("127.0.0.1:1", "127.0.0.1:2", "1", 0),    # the peer no longer had it at its capture
               ("127.0.0.1:3", "127.0.0.1:4", "2", 5)]    # no record for that rank at all
    assert netlock.confirmed(entries, "0", 0, read) == [[A, B]]
    assert netlock.confirmed(entries, "0", 7, read) == []     # the mirrored entry names another rank


def test_restore_key_is_per_network_namespace() -> None:
    import os
    key = rendezvous.restore_key(7, 1, 3)
    assert str(key) == f"7.1.3.{os.stat('/proc/self/ns/net').st_ino}"
    assert RestoreKey.parse(f"{key}.127.0.0.1_5-127.0.0.1_6") == key and RestoreKey.parse("7.1.x.4") is None


def test_a_hold_left_by_an_earlier_attempt_is_lifted_by_the_next_one(tmp_path: Path) -> None:
    ipt = FakeIptables()
    with netlock.hold_during_restore([[A, B]], RestoreKey(7, 0, 3, 1), ipt.filter(), CAP, tmp_path):
        pass                                 # restart 0: rank 1 never came (job requeued)
    with netlock.hold_during_restore([["127.0.0.1:9", "127.0.0.1:8"]], RestoreKey(8, 0, 3, 1), ipt.filter(), CAP, tmp_path):
        pass                                 # another job's hold stays
    assert held(ipt, 7) == 2 and held(ipt, 8) == 2
    with netlock.hold_during_restore([[A, "127.0.0.1:50001"]], RestoreKey(7, 1, 2, 1), ipt.filter(), CAP, tmp_path):
        assert held(ipt, 7) == 2             # restart 1 lifted restart 0's and added its own, in one batch
        assert ipt.filter().held(7).drops == frozenset(netlock.drops(A, "127.0.0.1:50001"))
    assert held(ipt, 8) == 2 and len(list(tmp_path.glob("7.1.*"))) == 1 and not list(tmp_path.glob("7.0.*"))


def test_one_verdict_per_restore_is_reached_without_the_node_lock(tmp_path: Path) -> None:
    """The first rank of a restore does the work on the user's path; no lock is held meanwhile (another job's
    restore takes its own at once), the other ranks of the same restore wait for the verdict, and a verdict
    that does not come is a bounded wait, never a hang."""
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
    with rendezvous.job_lock(7, tmp_path):
        took = time.monotonic() - took
    assert took < 1, "a lock was held around the work"
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


def test_the_check_counts_each_connection_between_the_jobs_trees_on_the_node_once() -> None:
    """What a restore of the job would hold on this node, seen from any of its trees: 3 connections between
    the two trees (counted once, whichever end looks), none for a connection inside one tree (one criu
    restores both ends) or to a process outside the job; Slurm is not asked for the job's other nodes
    while no connection leaves this one."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    code = (f"import socket, time\nc = [socket.create_connection(('127.0.0.1', {port})) for _ in range(5)]\n"
            "print('ok', flush=True)\ntime.sleep(60)")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "ok"
        accepted = [listener.accept()[0] for _ in range(5)]
        server = subprocess.Popen([sys.executable, "-c", "import time; print('ok', flush=True); time.sleep(60)"],
                                  pass_fds=[c.fileno() for c in accepted[:3]], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ok"
            for c in accepted[:3]:
                c.close()            # 2 stay with this process: outside the job

            def never() -> set[str]:
                raise AssertionError("asked Slurm for the job's nodes")
            tree = {server.pid: "0.1"}
            assert netlock.held_on_node([client.pid], tree, never) == (3, 0)
            assert netlock.held_on_node([server.pid], {client.pid: "0.0"}, never) == (3, 0)
            assert netlock.held_on_node([client.pid, server.pid], {}, never) == (0, 0)
        finally:
            server.kill(), server.wait()
    finally:
        client.kill(), client.wait()
        listener.close()


def test_the_jobs_end_removes_the_nftables_lock_criu_left_after_its_final_dumps(tmp_path: Path) -> None:
    """A final dump with criu's nftables lock leaves criu's table (two base chains) for the tree's restore on
    this node to remove; a tree restored elsewhere, or never, left it for good. The run id comes from the
    images (inventory.img), and the job's end removes the table whether the restore did or not."""
    import struct
    from slurmckpt.criu import images as criu_images
    run_id = "8246aa8f-a961-442a-bf1c-0123456789ab"
    entry = bytes([0x08, 0x02]) + bytes([13 << 3 | 2, len(run_id)]) + run_id.encode()      # img_version, run id
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "inventory.img").write_bytes(b"\0" * 8 + struct.pack("<I", len(entry)) + entry)
    assert criu_images.dump_run_id(tmp_path / "img") == run_id
    assert criu_images.dump_run_id(tmp_path) is None
    nft = FakeNftables()
    nft("add table inet CRIU-8246aa8f-a961-442a-bf\nadd table inet CRIU-0000aaaa-0000-0000-00\n")   # criu's
    locks = tmp_path / "locks"
    netlock.note_criu_lock(7, run_id, locks)
    netlock.note_criu_lock(7, run_id, locks)                                # two ranks' dumps, one table each
    netlock.note_criu_lock(7, "x; flush ruleset", locks)                   # never a name that is not criu's
    assert netlock.lift_job(7, [FakeIptables().filter(), nft.filter()], locks) == [
        "criu's nftables lock: 1 table(s) of final dumps"]
    assert list(nft.tables) == ["CRIU-0000aaaa-0000-0000-00"], "another run's table is not the job's"
    assert netlock.lift_job(7, [nft.filter()], locks) == []
