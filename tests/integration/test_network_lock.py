"""TCP held while a tree is dumped and restored, on a node without iptables (docs/architecture.md, "The node's
packet filter"): criu's own network lock and slurmckpt's holds between ranks go through nftables
(libnftables), chosen at run time where `iptables-restore` is missing or by `network_lock: nftables`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.slurmjob import AGENT_LOGS, site_config, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from ipc_pair import expected_lines  # noqa: E402

USER = "ckptuser1"
PYTHON = "/opt/slurmckpt/venv/bin/python"
HOLD = r"""
import socket, subprocess
from slurmckpt.node.packet_filter import Drop, Nftables, libnftables_run
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
drops = [Drop("127.0.0.1", cli.getsockname()[1], "127.0.0.1", srv.getsockname()[1])]
nft = Nftables()
nft.hold(drops, "slurmckpt test")
cli.sendall(b"x")
conn.settimeout(1.5)
try:
    print("delivered while held", conn.recv(1))
except socket.timeout:
    print("held")
nft.lift(drops, "slurmckpt test")
conn.settimeout(15)
print("after lift", conn.recv(1).decode())
libnftables_run("list table inet slurmckpt\n")
"""


def test_an_nftables_hold_drops_a_connections_packets_until_it_is_lifted() -> None:
    """In a network namespace of its own: a held connection's packets are dropped (never reset), and TCP
    delivers them once the hold is lifted."""
    p = subprocess.run(["unshare", "--net", PYTHON, "-c", HOLD], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:2] == ["held", "after lift x"], p.stdout


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
