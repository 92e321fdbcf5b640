"""An uncommitted epoch's lease: until when its ranks may still write it and its coordinator commit it
(docs/storage.md, "Leases"). Garbage collection (reclaim.py: every agent start, every capture of the job,
`slurmckpt gc`) removes an uncommitted epoch whose lease ran out.

The lease follows the epoch's work, not a fixed guess: the allocation gives it the configured phases'
limits (`base_s`); each rank's PREPARE extends it to cover its own capture at the rates the budget assumes
for its bytes (rank_images.reserve: a large epoch dumps and seals for longer than the limits); while a rank
persists, a keeper renews it every RENEW_EVERY_S (`kept`): a persist at bounded priority onto a slow store
takes as long as it takes, and the epoch stays leased exactly while a rank is working on it. Each rank keeps
its own lease file beside the allocation's (`.lease-<step>.<rank>`: no lock, no rank shortens another's);
the epoch's lease is the latest of them. A renewal of an epoch that is gone (collected) fails.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from slurmckpt.store import durable
from slurmckpt.store.durable import atomic_write_json
from slurmckpt.errors import EpochGone, StorageError

if TYPE_CHECKING:
    from slurmckpt.store.jobstore import JobStore

log = logging.getLogger("slurmckpt.lease")

LEASE = ".lease"
RENEW_EVERY_S = 60.0
MARGIN_S = 120.0
clock = time.time        # wall clock: leases are read on every node of a shared store


def base_s(config: Any) -> float:
    """A fresh epoch's lease: every phase it may take at the configured limits, and a margin."""
    return float(config.prepare_timeout_s + config.capture_timeout_s + config.persist_timeout_s + MARGIN_S)


def write(epoch_dir: Path, owner: str, expires_at: float, run: int | None = None) -> None:
    """The allocation's lease (the epoch directory was just made, under the job's lock)."""
    atomic_write_json(epoch_dir / LEASE, {"owner": owner, "expires_at": expires_at,
                                          **({"run": run} if run is not None else {})})


def expiry(epoch_dir: Path) -> float:
    """When the epoch's lease runs out: the latest of the allocation's and its ranks'. FileNotFoundError:
    it has none; ValueError: one is unreadable."""
    found = []
    for path in epoch_dir.glob(LEASE + "*"):
        if durable.is_temp(path.name):
            continue
        try:
            found.append(float(json.loads(path.read_text())["expires_at"]))
        except FileNotFoundError:
            continue
        except (KeyError, TypeError) as e:
            raise ValueError(f"lease {path.name} unreadable: {e}") from e
    if not found:
        raise FileNotFoundError(epoch_dir / LEASE)
    return max(found)


def extend(store: JobStore, epoch: int, holder: str, until: float) -> None:
    """The epoch stays leased at least until `until`, on behalf of `holder` (a rank name: each rank writes
    its own lease file beside the allocation's, so ranks never take a lock or shorten each other's lease).
    StorageError when the epoch directory is gone (its lease had run out and gc took it)."""
    where = store.epoch_dir(epoch)
    path = where / f"{LEASE}-{holder}"
    try:
        if until > _own(path):
            atomic_write_json(path, {"expires_at": until})
    except StorageError as e:
        if not where.is_dir():
            raise EpochGone("the epoch's directory is gone (withdrawn by an abort, or collected after its "
                            "lease ran out)", epoch=epoch) from e
        raise


def _own(path: Path) -> float:
    try:
        return float(json.loads(path.read_text())["expires_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


@contextmanager
def kept(store: JobStore, epoch: int, holder: str, window_s: float, every_s: float | None = None) -> Iterator[None]:
    """While inside: the epoch's lease reaches `window_s` past now, renewed every `every_s` (RENEW_EVERY_S)
    by a thread. The first renewal happens before anything runs (StorageError if the epoch is gone); a
    later one that fails is logged (the work inside then fails on the missing directory itself)."""
    every = RENEW_EVERY_S if every_s is None else every_s
    extend(store, epoch, holder, clock() + window_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every):
            try:
                extend(store, epoch, holder, clock() + window_s)
            except (OSError, StorageError) as e:
                log.warning("renewing the lease of epoch %d failed: %s", epoch, e)
    keeper = threading.Thread(target=renew, name=f"lease-{epoch}", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
