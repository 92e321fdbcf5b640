"""The persister of one rank's final capture (docs/storage.md, "The final capture and Slurm's SIGKILL"): root,
started by the rank's agent once the images are complete in the node's staging (rank/images.py hand_over),
outside the job's cgroups (node/detach.py), so that Slurm's SIGKILL does not end it. It compresses the staged
images into the store as a periodic capture's persist does (persist.py), at the same bounded priority (the
node may run the next job already), keeps a heartbeat that the next run's agents wait on, and then commits the
epoch if every rank's images are in the store (handover.py: whoever comes last commits). A failure withdraws
the epoch, recorded as the final capture's failure; the staging area goes either way.

It acts only where root's config and its argv put it: the agent passes the job, epoch, step and rank it
serves (from Slurm, never from the job), and everything else, the staging area and the store directory, is
derived from those here. What it reads in the staging area (`.handover`: the rank's record, the codec, the
priority) the agent wrote there; the directory is root's, mode 0700.

    slurmckpt persist-final --cluster C --job J --epoch E --step S --rank R      (root; the agent only)

The process around it (its logs, its leaving the job's cgroups) is cli/persist.py's.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from slurmckpt.errors import SlurmckptError
from slurmckpt.store import handover, lease
from slurmckpt.store.compression import from_settings
from slurmckpt.store.jobstore import JobStore, rank_name
from slurmckpt.store.persist import HANDOVER, Priority, persist_kept
from slurmckpt.store.record import Capture
from slurmckpt.store.staging import Staging

log = logging.getLogger("slurmckpt.final_persist")


def persist_handed(store: JobStore, staging: Staging, epoch: int, step: str, rank: int) -> bool:
    """The rank's staged final images into the store, then the epoch's commit if it is complete. Whether the
    rank's images are in the store."""
    name = rank_name(step, rank)
    where = staging.area(store.cluster, store.job, "capture", epoch, step, rank)
    try:
        with lease.kept(store, epoch, handover.heartbeat(name), handover.HEARTBEAT_S, handover.HEARTBEAT_EVERY_S):
            order = _order(where)
            manifest = persist_kept(store, epoch, step, rank, where, order["meta"], order["codec"],
                                    order["priority"], order["lease_s"])
    except (SlurmckptError, OSError, ValueError, KeyError, TypeError) as e:
        log.error("final epoch %d, rank %s: persist failed: %s", epoch, name, e)
        try:
            handover.abandon(store, epoch, f"persisting rank {name} failed: {e}", rank=name)
        except (SlurmckptError, OSError) as again:
            log.error("final epoch %d: withdrawing it failed too (%s); the next run's agents do", epoch, again)
        return False
    finally:
        staging.remove(where, wait=True)
    log.info("final epoch %d, rank %s: %d file(s) in the store", epoch, name, len(manifest.seal.files))
    try:
        handover.complete(store, epoch)
    except (SlurmckptError, OSError) as e:       # the next run's agents complete it (handover.settle)
        log.error("final epoch %d: commit failed: %s", epoch, e)
    return True


def _order(where: Path) -> dict[str, Any]:
    """What the agent handed over, each field checked (root wrote it; still a file read back)."""
    raw = json.loads((where / HANDOVER).read_text())
    codec = raw["codec"]
    priority = raw.get("priority")
    return {"meta": Capture.from_json(dict(raw["meta"])), "lease_s": float(raw["lease_s"]),
            "codec": from_settings(str(codec["name"]), int(codec["level"]), int(codec["threads"])),
            "priority": None if priority is None else Priority(int(priority["nice"]), str(priority["io_class"]))}

