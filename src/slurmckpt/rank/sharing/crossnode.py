"""TCP between ranks on two nodes of the job: captured with both ends frozen at the barrier, restored where
both addresses exist again (the job's original nodes), held until both ends are back.

Each end is restored by its own criu run on its own node, at its own time. After a final capture, criu's
network lock (left by each node's dump) drops a connection's packets on the node whose end is not back yet;
after a crash (a periodic epoch restored) nothing does, and the end restored first would get a RST from the
other node's kernel. So each end's restore drops its own outgoing packets of the connection (OUTPUT, on its
node) from before its criu restore until the other end has said, in the job's directory of the shared image
store, that it is back; then it lifts its rule and TCP retransmits what was dropped. An end that never comes
lifts the hold after `timeout_s`: the connection then resets, as it would without the hold. A job that ends
first has what it holds on the node lifted by its epilog (netlock.lift_job).

A node that lacks a recorded local address (the job was requeued onto other nodes) refuses the restore
before criu runs, naming the address and the node it belonged to.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from slurmckpt.rank.sharing import netlock, rendezvous
from slurmckpt.errors import RestoreError
from slurmckpt.node import packet_filter
from slurmckpt.node.packet_filter import Drop, PacketFilter
from slurmckpt.node.proctree import TcpConnection

log = logging.getLogger("slurmckpt.crossnode")


def job_connections(outside: list[TcpConnection], job_addresses: set[str]) -> list[list[str]]:
    """[local, remote] of the connections whose other end is on another node of the job."""
    return sorted([c.local, c.remote] for c in outside if c.remote_ip in job_addresses)


def require_local_addresses(entries: list[list[str]], local: set[str], node: str) -> None:
    """Refuse (before criu runs) a restore on a node that lacks an address the connections were made from."""
    missing = sorted({netlock.split_endpoint(lo)[0] for lo, _ in entries} - local)
    if missing:
        raise RestoreError(f"this checkpoint holds TCP connections between nodes of the job from "
                           f"{', '.join(missing)} (node {node} at the capture), which this node does not have: "
                           "such a job restores only on its original nodes (docs/mpi.md)")


def _drop(local: str, remote: str) -> Drop:
    (lh, lp), (rh, rp) = netlock.split_endpoint(local), netlock.split_endpoint(remote)
    return Drop(lh, lp, rh, rp)


class Hold:
    """One rank's ends of cross-node connections around its restore (see the module docstring). Its rules
    are in the job's rule set on this node (packet_filter.py), changed in one batch at a time under the
    job's lock (rendezvous.job_lock), at most `cap` connections for the job on the node (tcp_hold_max)."""

    def __init__(self, entries: list[list[str]], sync_dir: Path, key: str, job: int, packets: PacketFilter,
                 cap: int, timeout_s: float = 300.0, poll_s: float = 0.5, lock_dir: Path | None = None) -> None:
        self.entries, self.sync_dir, self.key, self.job = entries, sync_dir, key, job
        self.packets, self.cap, self.timeout_s, self.poll_s = packets, cap, timeout_s, poll_s
        self.lock_dir = lock_dir or rendezvous.LOCK_DIR
        self.held: dict[tuple[str, str], Drop] = {}
        self.thread: threading.Thread | None = None

    def _marker(self, local: str, remote: str) -> Path:
        """Said by the end `local` of the connection, once it is restored."""
        end = local.replace("[", "").replace("]", "").replace(":", "_")
        return rendezvous.marker(self.sync_dir, self.key, netlock.pair_id(local, remote), end)

    def before_restore(self) -> None:
        """Hold every end (RestoreError above the cap, before anything is held)."""
        if not self.entries:
            return
        drops = {(local, remote): _drop(local, remote) for local, remote in self.entries}
        try:
            with rendezvous.job_lock(self.job, self.lock_dir):
                packet_filter.update(self.packets, self.job, drops.values(), cap=self.cap)
            self.held = drops
        except OSError as e:            # no worse than before: the connections may be reset
            log.warning("cannot hold TCP to other nodes during the restore: %s", e)

    def after_restore(self) -> None:
        """This end is back: say so, and lift each rule once the other end has said the same."""
        self.sync_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for local, remote in self.entries:
            self._marker(local, remote).write_text(str(time.time()))
        if self.held:
            self.thread = threading.Thread(target=self._await_peers, daemon=True, name="crossnode-hold")
            self.thread.start()

    def release(self) -> None:
        """Lift every rule still held (the restore failed, or the wait is over)."""
        self._lift(list(self.held))

    def _lift(self, pairs: list[tuple[str, str]]) -> None:
        drops = [self.held.pop(pair) for pair in pairs]
        if not drops:
            return
        try:
            with rendezvous.job_lock(self.job, self.lock_dir):
                packet_filter.update(self.packets, self.job, remove=drops)
        except OSError as e:
            log.warning("cannot lift the hold on %s: %s", ", ".join(f"{a} -> {b}" for a, b in pairs), e)

    def _await_peers(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.held and time.monotonic() < deadline:
            back = [(local, remote) for local, remote in self.held if self._marker(remote, local).exists()]
            if back:
                log.info("%s: the other end is back, hold lifted", ", ".join(f"{a} -> {b}" for a, b in back))
                self._lift(back)
            time.sleep(self.poll_s)
        if self.held:
            log.warning("the other end of %s never came back within %.0fs: hold lifted",
                        ", ".join(f"{a} -> {b}" for a, b in self.held), self.timeout_s)
            self.release()
