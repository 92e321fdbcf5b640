"""TCP held while a tree is dumped and restored, on a node without iptables (docs/architecture.md, "The node's
packet filter"): criu's own network lock and slurmckpt's holds between ranks go through nftables
(libnftables), chosen at run time where `iptables-restore` is missing or by `network_lock: nftables`. And
the holds of a job with many connections in the real iptables and nftables, each in a network namespace of
its own: one rule set per job, room left for criu's own lock, nothing left once the job's end lifted it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.slurmjob import AGENT_LOGS, site_config, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from ipc_pair import expected_lines  # noqa: E402

USER = "ckptuser1"
PYTHON = "/opt/slurmckpt/venv/bin/python"
HOLD = r"""
import socket, subprocess
from slurmckpt.node.packet_filter import Drop, Nftables, libnftables_run, update
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
drops = [Drop("127.0.0.1", cli.getsockname()[1], "127.0.0.1", srv.getsockname()[1])]
nft = Nftables()
update(nft, 7, drops)
cli.sendall(b"x")
conn.settimeout(1.5)
try:
    print("delivered while held", conn.recv(1))
except socket.timeout:
    print("held")
update(nft, 7, remove=drops)
conn.settimeout(15)
print("after lift", conn.recv(1).decode())
print(libnftables_run("list tables\n").strip() or "no table left")
"""


MANY = r"""
import json, os, subprocess, sys, tempfile
from pathlib import Path
from slurmckpt.node import packet_filter
from slurmckpt.rank.sharing import netlock
from slurmckpt.rank.sharing.rendezvous import restore_key
method, count, workload = sys.argv[1], int(sys.argv[2]), sys.argv[3]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
port = Path(tempfile.mkdtemp()) / "port"
port.parent.chmod(0o777)
# the job's side, as its user: two processes (its ranks) with `count` connections between them
ranks = subprocess.Popen(["setpriv", "--reuid=ckptuser1", "--regid=ckptuser1", "--init-groups", sys.executable,
                          workload, "pair", "--connections", str(count), "--port-file", str(port)],
                         stdout=subprocess.PIPE, text=True)
server, client = map(int, ranks.stdout.readline().split()[1:])
pairs = [[lo, re] for lo, re, *_ in netlock.internal_connections([server], {client: ("1", 0)})]
packets = packet_filter.for_method(method)
lock_dir = Path(tempfile.mkdtemp())
key = restore_key(4242, 1, 1)
# the first rank's restore holds them; its peer's restore never comes: the job is killed mid-restore
netlock.hold_during_restore(pairs, key, packets, count, lock_dir).__enter__()
if method == "nftables":
    ruleset = packet_filter.libnftables_run("list ruleset\n")
    criu = "add table inet CRIU-probe\n" + "".join(
        f"add chain inet CRIU-probe {h} {{ type filter hook {h} priority 0 ; }}\n" for h in ("output", "input"))
else:
    ruleset = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    criu = ""
try:
    if criu:
        packet_filter.libnftables_run(criu)
    room = "criu's lock made"
except OSError as e:
    room = str(e)
held = len(packets.held(4242).drops)
lifted = netlock.lift_job(4242, packet_filter.installed(), lock_dir)          # what the job's end runs
after = packet_filter.libnftables_run("list ruleset\n") + subprocess.run(
    ["iptables-save"], capture_output=True, text=True).stdout
os.kill(client, 9)
ranks.kill()
print(json.dumps({"pairs": len(pairs), "held": held, "base_chains": ruleset.count("hook output"),
                  "chains": ruleset.count(":SLURMCKPT-"), "jumps": ruleset.count("-j SLURMCKPT-4242"),
                  "room": room, "lifted": lifted, "left": after.count("4242")}))
"""


@pytest.mark.parametrize("method", ["nftables", "iptables"])
def test_a_job_holding_1500_connections_is_one_rule_set_leaves_criu_room_and_goes_at_its_end(method: str) -> None:
    """ckptuser1's two processes hold 1500 connections; the first rank's restore holds them and its peer
    never comes (the job killed mid-restore). Before: 1500 base chains on nftables' output hook (criu's own
    lock could no longer be made past 1024, so every TCP capture on the node failed) or 3000 rules in
    OUTPUT, and nothing but the same job's next restore lifted them. Now: one table (one base chain) or one
    chain per job, criu's lock still made, and the job's end (netlock.lift_job) leaves nothing."""
    wd = workdir("ckptuser1", f"tcp-many-{method}")      # where ckptuser1 can read the workload (the repo may be
    p = subprocess.run(["unshare", "--net", PYTHON, "-c", MANY, method, "1500", str(wd / "tcp_many.py")],  # 0700)
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["pairs"] == 1500 and got["held"] == 3000, got
    if method == "nftables":
        assert got["base_chains"] == 1 and got["room"] == "criu's lock made", got
        assert got["lifted"] == ["nftables: 3000 rule(s)"], got
    else:
        assert got["chains"] == 1 and got["jumps"] == 1, got
        assert got["lifted"][0] == "iptables: 3000 rule(s)", got
    assert got["left"] == 0, got


def test_an_nftables_hold_drops_a_connections_packets_until_it_is_lifted() -> None:
    """In a network namespace of its own: a held connection's packets are dropped (never reset), and TCP
    delivers them once the hold is lifted."""
    p = subprocess.run(["unshare", "--net", PYTHON, "-c", HOLD], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:3] == ["held", "after lift x", "no table left"], p.stdout


def test_ranks_talking_over_tcp_restore_exactly_with_the_nftables_lock() -> None:
    """The job's two ranks hold a loopback TCP connection; dumped and restored with criu's nftables lock, and
    slurmckpt's hold between the two restores in nftables too: the output equals an uninterrupted run's."""
    wd = workdir(USER, "nftables")
    with site_config("network_lock: nftables\n"):
        job = submit(USER, wd, "#!/bin/bash\nsrun -n2 python3 ipc_pair.py --mech tcp --steps 120 --sleep 0.2\n",
                     "-n2", "-N1", "--checkpoint-interval=10s")
        job.wait_output(r"committed \(interval\)")
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    for rank in (0, 1):
        assert [l for l in job.app_lines() if l.startswith(f"r{rank} ")] == expected_lines(rank, 120)
    logs = "".join(p.read_text(errors="replace") for p in AGENT_LOGS.glob(f"agent-{job.id}.*.log"))
    assert "network lock: nftables" in logs, logs[-2000:]
    assert job.restarts() == 1
