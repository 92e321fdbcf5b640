"""TCP between two ranks on one node (loopback or the node's own address): hold its packets while only one end
has been restored.

Each rank is restored by its own `criu restore`, at its own time. A restored end that sends (its process
writes, or the kernel retransmits what was in flight) to an end not restored yet gets a RST: the connection
is reset (measured: ECONNRESET on both ranks after a 2 s stagger). After a final capture on the same node
this does not happen, because `criu dump` leaves DROP rules on the connection that each side's restore
removes for its own end; after a crash (periodic images) or a restore on another node there are none.

So the first rank of the node to restore an end of such a connection adds DROP rules for both directions
(tagged with the job, so criu's own rules stay independent), and the last one to finish its restore removes
them: packets are dropped, never answered by a RST, while one end is missing, and TCP retransmits them when
both are back. Who is first and last is decided under a node-wide flock, with a counter file per connection
keyed by job, restart, epoch and network namespace. Only connections both ranks' records hold are held
(`confirmed`), so the last end always comes (or fails, which lifts the hold as well). The rules go through
packet_filter.py (iptables or nftables, as criu's own lock).
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from slurmckpt.node import proctree
from slurmckpt.node.packet_filter import Drop, PacketFilter
from slurmckpt.rank.sharing import rendezvous
from slurmckpt.rank.sharing.rendezvous import RestoreKey

log = logging.getLogger("slurmckpt.netlock")



def _established(pids: list[int]) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, inode) of every ESTABLISHED TCP socket of the network namespace of `pids`."""
    if not pids:
        return []
    return [(proctree._hex_addr(f[1]), proctree._hex_addr(f[2]), f[9]) for f in proctree.tcp_table(pids[0])
            if f[3] == "01"]


def internal_connections(pids: list[int], peers: dict[int, tuple[str, int]]) -> list[tuple[str, str, str, int]]:
    """Established TCP connections of the tree `pids` whose other end is a socket held by one of `peers`
    (pid -> (step, rank) of another rank of the job): (local, remote, peer step, peer rank). Loopback or the
    node's own address (MPI daemons use it): both ends are in this network namespace, so on this node."""
    ours = proctree.socket_inodes(pids)
    if not ours:
        return []
    rows = _established(pids)
    mine = [(lo, re) for lo, re, ino in rows if ino in ours]
    if not mine:
        return []
    holder = {ino: pid for pid in peers for ino in proctree.socket_inodes([pid])}
    by_tuple = {(lo, re): ino for lo, re, ino in rows}
    out = []
    for lo, re in mine:
        pid = holder.get(by_tuple.get((re, lo), ""))
        if pid is not None:
            out.append((_fmt(lo), _fmt(re), *peers[pid]))
    return out


def still_established(pids: list[int], connections: list[tuple[str, str, str, int]]) -> list[list[Any]]:
    """The entries of `connections` (see internal_connections) that the tree still holds established."""
    ours = proctree.socket_inodes(pids)
    now = {(_fmt(lo), _fmt(re)) for lo, re, ino in _established(pids) if ino in ours} if ours else set()
    return [list(c) for c in connections if (c[0], c[1]) in now]


def confirmed(entries: list[list[Any]], step: str, rank: int,
              peer_record: Callable[[str, int], dict[str, Any]]) -> list[list[str]]:
    """The connections of this rank's record that the peer rank's record (`peer_record(step, rank)` -> its
    rank.json) holds too, mirrored: only those are held, since only then will both ends be restored and
    the last one lift the hold."""
    out, cache = [], {}
    for local, remote, peer_step, peer_rank in entries:
        key = (str(peer_step), int(peer_rank))
        if key not in cache:
            try:
                cache[key] = {tuple(e) for e in peer_record(*key).get("tcp_ranks", [])}
            except Exception:  # noqa: BLE001 - no record for that rank: not held
                cache[key] = set()
        if (remote, local, str(step), int(rank)) in cache[key]:
            out.append([local, remote])
    return out


def _fmt(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port)


def drops(local: str, remote: str) -> list[Drop]:
    """Both directions of one connection."""
    (lh, lp), (rh, rp) = split_endpoint(local), split_endpoint(remote)
    return [Drop(lh, lp, rh, rp), Drop(rh, rp, lh, lp)]


def pair_id(local: str, remote: str) -> str:
    a, b = sorted((local, remote))
    return f"{a}-{b}".replace("[", "").replace("]", "").replace(":", "_")


@contextmanager
def hold_during_restore(connections: list[list[str]], key: RestoreKey, tag: str, packets: PacketFilter,
                        lock_dir: Path | None = None) -> Iterator[None]:
    """Around one rank's `criu restore`: `connections` [(local, remote)] are this rank's ends of node-local
    connections to other ranks that the peer's record holds too (`confirmed`); `key` names this restore of
    the job on this node (`restore_key`), the same on every rank. The rules exist from before the first end
    is restored until the second one has been (or has failed: then its peer sees the reset instead of
    waiting forever). Holds left by an earlier attempt of the same job (a rank that never came: the job was
    requeued) are lifted first."""
    if not connections:
        yield
        return
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    with rendezvous.node_lock(lock_dir):
        _lift_stale(key, packets, lock_dir)
        for local, remote in connections:
            marker = rendezvous.marker(lock_dir, key, pair_id(local, remote))
            if not marker.exists():
                held = drops(local, remote)
                marker.write_text(json.dumps({"done": 0, "filter": packets.name, "tag": tag,
                                              "drops": [d.to_list() for d in held]}))
                try:
                    packets.hold(held, tag)
                except OSError as e:        # no worse than before: the connection may be reset
                    log.warning("cannot hold TCP between ranks during the restore (%s): %s", packets.name, e)
    try:
        yield
    finally:
        with rendezvous.node_lock(lock_dir):
            for local, remote in connections:
                marker = rendezvous.marker(lock_dir, key, pair_id(local, remote))
                try:
                    state = json.loads(marker.read_text())
                except (OSError, ValueError):
                    continue
                state["done"] += 1
                if state["done"] >= 2:
                    _unlock(packets, marker, state)
                else:
                    marker.write_text(json.dumps(state))


def _unlock(packets: PacketFilter, marker: Path, state: dict[str, Any]) -> None:
    try:
        packets.lift([Drop.from_list(d) for d in state["drops"]], str(state["tag"]))
    except OSError as e:
        log.warning("lifting the hold on TCP between ranks failed: %s", e)
    marker.unlink(missing_ok=True)


def _lift_stale(key: RestoreKey, packets: PacketFilter, lock_dir: Path) -> None:
    """Holds of the same job from another restart on this node (network namespace): that attempt's trees
    are gone (Slurm requeued the job), so a hold it left (its other end never came) only blocks the ports."""
    for marker in lock_dir.glob(f"{key.job}.*"):
        theirs, rest = RestoreKey.parse(marker.name), marker.name.split(".", 4)[4:]
        if theirs is None or not rest or theirs.same_restart(key) or theirs.netns != key.netns \
                or rest[0].startswith("file."):
            continue
        try:
            _unlock(packets, marker, json.loads(marker.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            marker.unlink(missing_ok=True)
