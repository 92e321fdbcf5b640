"""What a job's user may know about its checkpoints, without reading the root-only store
(docs/operations.md, "What users see").

The agents publish a per-job summary, `<summary_dir>/<cluster>/<job>.json`: epochs (number, time, trigger,
ranks, nodes, bytes), withdrawn epochs, recent failed captures, slurmckpt's note and the current run. It is
rebuilt from the store (root-only) every time, never read back by root: the file belongs to the job's uid,
mode 0400, in root-owned 0755 directories, so its user can read it and nobody else can (other users get
EACCES), and nobody but root can replace it. The images stay under the root-only (0700) store.
"""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict
from pathlib import Path

from slurmckpt.errors import PermissionDenied, StorageError
from slurmckpt.storage import JobStore, atomic_write_json

RUN_FILE = "run.json"            # root-only, in the job's store: the current run as its batch agent saw it
FAILURES_SHOWN = 5


def epoch_bytes(store: JobStore, entry: dict) -> int:
    """Bytes of a committed epoch's images (every rank that has any)."""
    total = 0
    for name, record in entry.get("ranks", {}).items():
        if record.get("kind") not in ("image", "replay"):
            continue
        step, _, rank = name.rpartition(".")
        try:
            total += sum(int(f.get("size", 0)) for f in store.read_rank_manifest(entry["epoch"], step,
                                                                                 int(rank))["files"].values())
        except (StorageError, ValueError, KeyError, TypeError):
            continue
    return total


def update_run(store: JobStore, fields: dict) -> None:
    """The batch agent's record of the current run (`restart_count` starts a new one)."""
    from slurmckpt.instance import store_lock
    with store_lock(store):
        run = {} if "restart_count" in fields else _json(store.job_dir / RUN_FILE)
        atomic_write_json(store.job_dir / RUN_FILE, {**run, **fields})


def build(store: JobStore) -> dict:
    """The summary of a job's store as it is now."""
    from slurmckpt.fresh_start import failures
    from slurmckpt.slurm.comment import STATE_FILE
    manifest = store.read_manifest()
    epochs = []
    for e in sorted(manifest.get("epochs", []), key=lambda e: e["epoch"], reverse=True):
        ranks = e.get("ranks", {})
        epochs.append({"epoch": e["epoch"], "committed_at": e.get("committed_at"), "trigger": e.get("reason"),
                       "ranks": len(ranks), "bytes": epoch_bytes(store, e),
                       "nodes": sorted({r["node"] for r in ranks.values() if r.get("node")})})
    withdrawn = [{"epoch": r.get("epoch"), "at": r.get("at"), "reason": r.get("reason")}
                 for r in manifest.get("rejected", [])]
    failed = [asdict(f) for f in failures(store)]
    return {"version": 1, "cluster": store.cluster, "job": store.job, "updated_at": time.time(),
            "epochs": epochs, "withdrawn": withdrawn, "failed_captures": failed[:FAILURES_SHOWN],
            "note": _json(store.job_dir / STATE_FILE).get("note"), "run": _json(store.job_dir / RUN_FILE)}


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def path_of(summary_dir: str, cluster: str, job: int) -> Path:
    return Path(summary_dir) / cluster / f"{job}.json"


def publish(store: JobStore, summary_dir: str, uid: int) -> Path:
    """Root: (re)write the job's summary for its user. Raises OSError/PermissionDenied when the summary
    directory is not a root-owned directory (a symlink, another owner, group/world-writable)."""
    target = path_of(summary_dir, store.cluster, store.job)
    for d in (target.parent.parent, target.parent):
        try:
            os.mkdir(d, 0o755)
            os.chmod(d, 0o755)          # whatever the umask slurmstepd left: users traverse it
        except FileExistsError:
            pass
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise PermissionDenied("summary directory is not a root-owned directory others cannot write", path=str(d))
    data = json.dumps(build(store), indent=1, sort_keys=True).encode()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchown(fd, uid, -1)
        os.fchmod(fd, 0o400)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, target)
    return target


def read(summary_dir: str, cluster: str, job: int) -> dict | None:
    """As the caller (a user reads only their own jobs'): the summary, or None when there is none or the
    caller may not read it."""
    try:
        value = json.loads(path_of(summary_dir, cluster, job).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
