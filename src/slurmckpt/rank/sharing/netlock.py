"""TCP between two ranks on one node (loopback or the node's own address): hold its packets while only one end
has been restored.

Each rank is restored by its own `criu restore`, at its own time. A restored end that sends (its process
writes, or the kernel retransmits what was in flight) to an end not restored yet gets a RST: the connection
is reset (measured: ECONNRESET on both ranks after a 2 s stagger). After a final capture `criu dump` leaves
its own lock on the connection for each side's restore on the same node to remove, but the job's epilog
removes it first (`lift_job`: a tree restored elsewhere or never would leave it for good), and after a crash
(periodic images) or on another node there is none.

So the first rank of the node to restore an end of such a connection adds DROP rules for both directions
(in the job's own rule set, so criu's own rules stay independent), and the last one to finish its restore
removes them: packets are dropped, never answered by a RST, while one end is missing, and TCP retransmits
them when both are back. Who is first and last is decided under the job's lock (rendezvous.job_lock: no
other job waits for it), with one file of counters per restore, keyed by job, restart, epoch and network
namespace. Only connections both ranks' records hold are held (`confirmed`), so the last end comes (or
fails, which lifts the hold as well) unless the job ends first: then its epilog lifts everything the job
holds on the node (`lift_job`, from store/job_end.py through rank/leftovers.py), and gc does once Slurm says the job is gone. The
rules go through packet_filter.py (iptables or nftables, as criu's own lock): one batch per rank's restore
whatever the number of connections, and at most `tcp_hold_max` connections per job and node, which the
capture's check already refuses to exceed (`held_on_node`).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re as regex
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from slurmckpt.node import proctree
from slurmckpt.errors import RestoreError
from slurmckpt.node import packet_filter
from slurmckpt.node.packet_filter import Drop, Nftables, PacketFilter
from slurmckpt.rank.sharing import rendezvous
from slurmckpt.rank.sharing.rendezvous import RestoreKey

log = logging.getLogger("slurmckpt.netlock")

CRIU_TABLE = regex.compile(r"CRIU-[0-9a-f-]{1,21}")     # criu's lock table: its run id (a uuid) cut to 31 characters



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


def confirmed(entries: Sequence[tuple[str, str, str, int]], step: str, rank: int,
              peer_record: Callable[[str, int], Sequence[tuple[str, str, str, int]]]) -> list[list[str]]:
    """The connections of this rank's record that the peer rank's record (`peer_record(step, rank)` -> its
    rank.json's tcp_ranks) holds too, mirrored: only those are held, since only then will both ends be
    restored and the last one lift the hold."""
    out, cache = [], {}
    for local, remote, peer_step, peer_rank in entries:
        key = (str(peer_step), int(peer_rank))
        if key not in cache:
            try:
                cache[key] = {tuple(e) for e in peer_record(*key)}
            except Exception:  # noqa: BLE001 - no record for that rank: not held
                cache[key] = set()
        if (remote, local, str(step), int(rank)) in cache[key]:
            out.append([local, remote])
    return out


def held_on_node(pids: list[int], trees: dict[int, Any], job_addresses: Callable[[], set[str]]) -> tuple[int, int]:
    """(connections between the job's trees on this node, their connections to other nodes of the job): what
    a restore of the job holds on this node, counted over every tree of the job here (`pids`: this tree;
    `trees`: pid -> tree name of the job's other trees), each connection once. `job_addresses()` (a
    question to Slurm) is asked only when a tree has TCP leaving the node."""
    owner = {ino: "" for ino in proctree.socket_inodes(pids)}
    by_tree: dict[Any, list[int]] = {}
    for pid, name in trees.items():
        by_tree.setdefault(name, []).append(pid)
    for name, members in by_tree.items():
        owner.update({ino: str(name) for ino in proctree.socket_inodes(members)})
    rows = _established(pids)
    by_tuple = {(lo, re): ino for lo, re, ino in rows}
    pairs, leaving = set(), []
    for lo, re, ino in rows:
        if ino not in owner:
            continue
        peer = by_tuple.get((re, lo))
        if peer in owner:
            if owner[peer] != owner[ino]:
                pairs.add(frozenset((lo, re)))
        elif not ipaddress.ip_address(re[0]).is_loopback:
            leaving.append(re[0])
    to_nodes = job_addresses() if leaving else set()
    return len(pairs), sum(1 for ip in leaving if ip in to_nodes)


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
def hold_during_restore(connections: list[list[str]], key: RestoreKey, packets: PacketFilter, cap: int,
                        lock_dir: Path | None = None) -> Iterator[None]:
    """Around one rank's `criu restore`: `connections` [(local, remote)] are this rank's ends of node-local
    connections to other ranks that the peer's record holds too (`confirmed`); `key` names this restore of
    the job on this node (`restore_key`), the same on every rank. The rules exist from before the first end
    is restored until the second one has been (or has failed: then its peer sees the reset instead of
    waiting forever). Holds left by an earlier attempt of the same job (a rank that never came: the job was
    requeued) are lifted in the same batch. `cap` (config tcp_hold_max): most connections the job holds on
    this node; above it the restore is refused (RestoreError) before anything is held. The restore's
    counters are one file (`<key>.tcp`: pair -> ends back, rules), so that the work under the job's lock is
    a few file operations and one packet filter batch whatever the number of connections."""
    if not connections:
        yield
        return
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    with rendezvous.job_lock(key.job, lock_dir):
        path = _counters(lock_dir, key)
        state, stale = _load(path), _stale(key, lock_dir)
        new = {pair_id(local, remote): drops(local, remote) for local, remote in connections}
        new = {pair: held for pair, held in new.items() if pair not in state}
        try:
            if new or stale:
                packet_filter.update(packets, key.job, [d for ds in new.values() for d in ds],
                                     [d for ds in stale.values() for d in ds], cap)
        except RestoreError:
            _finish(connections, key, packets, lock_dir)      # the peers restored already are not held on
            raise
        except OSError as e:        # no worse than before: the connection may be reset
            log.warning("cannot hold TCP between ranks during the restore (%s): %s", packets.name, e)
        for old in stale:
            old.unlink(missing_ok=True)
        log.info("TCP between ranks held during the restore: %d connection(s) of this rank, %d new (%s)",
                 len(connections), len(new), packets.name)
        state.update({pair: {"done": 0, "drops": [d.to_list() for d in held]} for pair, held in new.items()})
        _save(path, state)
    try:
        yield
    finally:
        with rendezvous.job_lock(key.job, lock_dir):
            _finish(connections, key, packets, lock_dir)


def _counters(lock_dir: Path, key: RestoreKey) -> Path:
    return rendezvous.marker(lock_dir, key, "tcp")


def _load(path: Path) -> dict[str, dict[str, Any]]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _save(path: Path, state: dict[str, dict[str, Any]]) -> None:
    if not state:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state))
    os.rename(tmp, path)


def _finish(connections: list[list[str]], key: RestoreKey, packets: PacketFilter, lock_dir: Path) -> None:
    """This end is back (or failed): connections whose both ends are are lifted, in one batch."""
    path = _counters(lock_dir, key)
    state = _load(path)
    lifting: list[Drop] = []
    for local, remote in connections:
        entry = state.get(pair_id(local, remote))
        if not isinstance(entry, dict):
            continue
        entry["done"] = int(entry.get("done", 0)) + 1
        if entry["done"] >= 2:
            lifting += _drops_of(entry)
            del state[pair_id(local, remote)]
    _save(path, state)
    if not lifting:
        return
    log.info("TCP between ranks: both ends of %d connection(s) back, hold lifted", len(lifting) // 2)
    try:
        packet_filter.update(packets, key.job, remove=lifting)
    except OSError as e:
        log.warning("lifting the hold on TCP between ranks failed: %s", e)


def _drops_of(entry: dict[str, Any]) -> list[Drop]:
    try:
        return [Drop.from_list(d) for d in entry["drops"]]
    except (KeyError, TypeError, ValueError):
        return []


def _stale(key: RestoreKey, lock_dir: Path) -> dict[Path, list[Drop]]:
    """Holds of the same job from another restart on this node (network namespace): that attempt's trees
    are gone (Slurm requeued the job), so a hold it left (its other end never came) only blocks the ports."""
    out = {}
    for path in lock_dir.glob(f"{key.job}.*.tcp"):
        theirs = RestoreKey.parse(path.name)
        if theirs is None or theirs.same_restart(key) or theirs.netns != key.netns:
            continue
        out[path] = [d for entry in _load(path).values() if isinstance(entry, dict) for d in _drops_of(entry)]
    return out


def note_criu_lock(job: int, run_id: str | None, lock_dir: Path | None = None) -> None:
    """After a final dump with criu's nftables lock: criu leaves its table (`inet CRIU-<run id>`, two base
    chains on the node's hooks) for the tree's restore on this node to remove. A tree restored elsewhere, or
    never, would leave it for good, and 512 of them leave criu no room to lock anything on the node: the
    job's end removes it (`lift_job`)."""
    table = f"CRIU-{run_id}"[:26] if run_id else ""
    if not CRIU_TABLE.fullmatch(table):
        return
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    path = rendezvous.marker(lock_dir, rendezvous.restore_key(job, 0, 0), "criu")
    with rendezvous.job_lock(job, lock_dir):
        tables = _criu_tables(path)
        if table not in tables:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(tables + [table]))
            os.rename(tmp, path)


def _criu_tables(path: Path) -> list[str]:
    try:
        tables = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [t for t in tables if isinstance(t, str) and CRIU_TABLE.fullmatch(t)] if isinstance(tables, list) else []


def lift_job(job: int, filters: list[PacketFilter], lock_dir: Path | None = None) -> list[str]:
    """Everything the job holds on this node (the job left it: its epilog, or gc once Slurm says it is
    gone): its rule set in every packet filter the node has, and its markers of this network namespace.
    What was lifted, one line per filter; a filter that failed is named as such."""
    lock_dir = lock_dir or rendezvous.LOCK_DIR
    said = []
    netns = rendezvous.restore_key(job, 0, 0).netns
    with rendezvous.job_lock(job, lock_dir):
        for packets in filters:
            try:
                count = packet_filter.lift_job(packets, job)
            except OSError as e:
                said.append(f"{packets.name}: FAILED: {e}")
                continue
            if count:
                said.append(f"{packets.name}: {count} rule(s)")
        for path in lock_dir.glob(f"{job}.*.tcp"):
            theirs = RestoreKey.parse(path.name)
            if theirs is not None and theirs.job == job and theirs.netns == netns:
                path.unlink(missing_ok=True)
        said += _lift_criu_locks(rendezvous.marker(lock_dir, RestoreKey(job, 0, 0, netns), "criu"), filters)
    return said


def _lift_criu_locks(path: Path, filters: list[PacketFilter]) -> list[str]:
    """The tables criu's final dumps of the job left on this node (`note_criu_lock`)."""
    tables = _criu_tables(path)
    nft = next((f for f in filters if isinstance(f, Nftables)), None)
    if not tables or nft is None:
        return []
    try:
        nft.execute("".join(f"add table inet {t}\ndelete table inet {t}\n" for t in tables), 0)
    except OSError as e:
        return [f"criu's nftables lock: FAILED: {e}"]
    path.unlink(missing_ok=True)
    return [f"criu's nftables lock: {len(tables)} table(s) of final dumps"]
