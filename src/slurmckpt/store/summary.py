"""What a job's user may know about its checkpoints, without reading the root-only store
(docs/operations.md, "What users see").

The agents publish a per-job summary, `<summary_dir>/<cluster>/<job>.json`: epochs (number, time, trigger,
ranks, nodes, bytes), withdrawn epochs, recent failed captures, slurmckpt's note, the current run and the
automatic interval (--checkpoint-interval=auto: as the job's coordinator chose it, with its inputs); once the
job is finished, when and why its images were removed (the summary stays). It is rebuilt from the store
(root-only) every time. The file is root's, mode 0440 through a POSIX ACL whose one
named entry gives the job's uid read access (`user:<uid>:r--`, no group, nobody else), in root-owned 0755
directories: its user reads it, other users get EACCES, and nobody but root can write, chmod, replace or
remove it (a file owned by the user was theirs to rewrite, and root's CLI read it). A file system without
POSIX ACLs keeps it root's alone (a warning says so). Readers (`read`) take only a regular root-owned
file nobody else can write, of bounded size, and keep only the fields and types `build` writes, for the
job and cluster asked. The images stay under the root-only (0700) store.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import struct
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slurmckpt.errors import PermissionDenied, ProtocolError, StorageError
from slurmckpt.store.jobstore import JobStore, atomic_write_json
from slurmckpt import validate

log = logging.getLogger("slurmckpt.summary")

RUN_FILE = "run.json"            # root-only, in the job's store: the current run as its batch agent saw it
INTERVAL_FILE = "interval.json"  # root-only, in the job's store: the automatic interval last chosen
MAX_STALLS = 16                  # stall samples an interval record keeps (coordinator/interval.py uses 5)
FAILURES_SHOWN = 5
MAX_BYTES = 1 << 20              # a summary holds keep_epochs epochs and 5 failures: far below this
MAX_LIST = 1000                  # entries of a list in a summary that a reader keeps
MAX_STEPS, MAX_LINE = 16, 600    # GPU transport lines of a run: steps kept, characters of a line
ACL_XATTR = "system.posix_acl_access"


def epoch_bytes(store: JobStore, entry: dict[str, Any]) -> int:
    """Bytes of a committed epoch's images (every rank that has any)."""
    total = 0
    for name, record in entry.get("ranks", {}).items():
        if record.get("kind") not in ("image", "replay"):
            continue
        try:
            step, rank = validate.rank_name(name)
            total += sum(int(f.get("size", 0)) for f in store.read_rank_manifest(entry["epoch"], step,
                                                                                 rank).seal.files.values())
        except (StorageError, ProtocolError, ValueError, KeyError, TypeError):
            continue
    return total


def update_run(store: JobStore, fields: dict[str, Any]) -> None:
    """The batch agent's record of the current run (`restart_count` starts a new one)."""
    from slurmckpt.store.instance import store_lock
    with store_lock(store):
        run = {} if "restart_count" in fields else _json(store.job_dir / RUN_FILE)
        atomic_write_json(store.job_dir / RUN_FILE, {**run, **fields})


def record_gpu_transports(store: JobStore, step: str, line: str) -> None:
    """What a step's GPU tasks run NCCL's intra-node traffic over, on a node with several of the job's GPUs
    (cuda/nccl.py): one line per step in the current run's record, said by the step's rank 0."""
    from slurmckpt.store.instance import store_lock
    with store_lock(store):
        run = _json(store.job_dir / RUN_FILE)
        lines = _lines(run.get("gpu_transports"))
        lines[step] = line
        atomic_write_json(store.job_dir / RUN_FILE, {**run, "gpu_transports": dict(list(lines.items())[-MAX_STEPS:])})


def _lines(v: object) -> dict[str, str]:
    """step -> line, as record_gpu_transports writes them (others dropped)."""
    if not isinstance(v, dict):
        return {}
    return {k[:64]: t[:MAX_LINE] for k, t in list(v.items())[:MAX_STEPS] if isinstance(k, str) and isinstance(t, str)}


def interval_record(choice: object) -> dict[str, Any]:
    """The automatic interval as the job's coordinator chose it (coordinator/interval.Choice.as_dict: sent by
    the job user's process, read back by the same user), each field of its type and bounded; {} if none."""
    if not isinstance(choice, dict):
        return {}
    out: dict[str, object] = {}
    for key in ("interval_s", "min_s", "max_s"):
        if _int(choice.get(key)) is not None and 0 <= choice[key] <= 2**31:
            out[key] = choice[key]
    for key in ("stall_s", "mtbi_s", "young_s", "daly_s", "chosen_at"):
        if _num(choice.get(key)) is not None and 0 <= choice[key] < 1e12:
            out[key] = choice[key]
    for key in ("basis", "bound", "min_from", "max_from"):
        if isinstance(choice.get(key), str):
            out[key] = choice[key][:200]
    stalls = choice.get("stalls")
    out["stalls"] = [s for s in stalls[-MAX_STALLS:] if _num(s) is not None and 0 <= s < 1e9] \
        if isinstance(stalls, list) else []
    told = choice.get("interruptions")
    out["interruptions"] = {k[:40]: v[:500] if isinstance(v, str) else v
                            for k, v in list(_scalars(told).items())[:20]
                            if type(v) not in (int, float) or _num(v) is not None} if isinstance(told, dict) else {}
    return out


def record_interval(store: JobStore, choice: object) -> None:
    atomic_write_json(store.job_dir / INTERVAL_FILE, interval_record(choice))


def recorded_stalls(store: JobStore) -> list[float]:
    """The stalls of the job's recent captures, as the last interval record holds them (a requeued job's new
    coordinator starts from them instead of auto_first_interval)."""
    return list(interval_record(_json(store.job_dir / INTERVAL_FILE)).get("stalls", []))


def build(store: JobStore) -> dict[str, Any]:
    """The summary of a job's store as it is now."""
    from slurmckpt.store.fresh_start import failures
    from slurmckpt.store.job_comment import STATE_FILE
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
            "note": _json(store.job_dir / STATE_FILE).get("note"), "run": _json(store.job_dir / RUN_FILE),
            "interval": interval_record(_json(store.job_dir / INTERVAL_FILE))}


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def path_of(summary_dir: str, cluster: str, job: int) -> Path:
    return Path(summary_dir) / cluster / f"{job}.json"


def publish(store: JobStore, summary_dir: str, uid: int, removed: dict[str, Any] | None = None) -> Path:
    """Root: (re)write the job's summary for its user; `removed` ({at, why}): its images are about to go
    (reclaim.py), the summary stays. Raises OSError/PermissionDenied when the summary directory is not a
    root-owned directory (a symlink, another owner, group/world-writable)."""
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
    data = json.dumps({**build(store), **({"images_removed": removed} if removed else {})}, indent=1,
                      sort_keys=True).encode()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o400)
        _let_read(fd, uid, target)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, target)
    return target


def _let_read(fd: int, uid: int, target: Path) -> None:
    """The job's uid, and it alone, may read the root-owned file: an access ACL (acl(5), the xattr's binary
    form) of owner r, user:<uid> r, group none, mask r, other none."""
    if not _set_acl(fd, uid):
        log.warning("%s: the file system has no POSIX ACLs, so the job's user cannot read its summary "
                    "(it stays root's alone)", target)


def _set_acl(fd: int, uid: int) -> bool:
    undefined = 0xFFFFFFFF
    entries = ((0x01, 4, undefined), (0x02, 4, uid), (0x04, 0, undefined), (0x10, 4, undefined), (0x20, 0, undefined))
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, who) for tag, perm, who in entries)
    try:
        os.setxattr(fd, ACL_XATTR, acl)
        return True
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return False


def users_can_read(summary_dir: str) -> bool:
    """For `slurmckpt doctor`: whether summaries in `summary_dir` can be given to their users (POSIX ACLs),
    tried on a temporary file there."""
    fd, tmp = tempfile.mkstemp(dir=summary_dir, prefix=".acl-probe-")
    try:
        return _set_acl(fd, 65534)
    finally:
        os.close(fd)
        os.unlink(tmp)


def read(summary_dir: str, cluster: str, job: int) -> dict[str, Any] | None:
    """As the caller (a user reads only their own jobs'): the summary, or None when there is none, the caller
    may not read it, or it is not one root wrote (not a regular file, not root's, writable by others, larger
    than MAX_BYTES, not JSON). Only the fields and types `build` writes are kept (`checked`)."""
    try:
        fd = os.open(path_of(summary_dir, cluster, job), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022 or st.st_size > MAX_BYTES:
            return None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return checked(value, cluster, job)


def _int(v: object) -> int | None:
    return v if type(v) is int else None


def _num(v: object) -> float | None:
    return v if isinstance(v, (int, float)) and type(v) is not bool and v == v and abs(v) != float("inf") else None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _dicts(v: object) -> list[dict[str, Any]]:
    return [d for d in v[:MAX_LIST] if isinstance(d, dict)] if isinstance(v, list) else []


def checked(value: object, cluster: str, job: int) -> dict[str, Any] | None:
    """The summary as `build` writes it, each field of its type (a field that is not is left out, an entry
    whose number is not one is dropped), for `cluster` and `job` only: what readers act on or print."""
    if not isinstance(value, dict) or value.get("cluster") != cluster or value.get("job") != job:
        return None
    epochs = [{"epoch": e["epoch"], "committed_at": _num(e.get("committed_at")), "trigger": _str(e.get("trigger")),
               "ranks": _int(e.get("ranks")) or 0, "bytes": _int(e.get("bytes")) or 0,
               "nodes": [n for n in e.get("nodes", [])[:MAX_LIST] if isinstance(n, str)]
               if isinstance(e.get("nodes"), list) else []}
              for e in _dicts(value.get("epochs")) if _int(e.get("epoch")) is not None]
    withdrawn = [{"epoch": _int(w.get("epoch")), "at": _num(w.get("at")), "reason": _str(w.get("reason"))}
                 for w in _dicts(value.get("withdrawn"))]
    failed = [f for f in _dicts(value.get("failed_captures")) if _failure(f)]
    run: dict[str, Any] = value["run"] if isinstance(value.get("run"), dict) else {}
    run_types = {"restart_count": _int, "started_at": _num, "batch_node": _str, "interval_s": _int,
                 "disabled": _str, "restored_epoch": _int, "fresh_start": _str}
    kept_run: dict[str, Any] = {k: check(run[k]) for k, check in run_types.items() if k in run and check(run[k]) is not None}
    if run.get("gpu_transports"):
        kept_run["gpu_transports"] = _lines(run["gpu_transports"])
    if isinstance(run.get("policy"), dict):            # policy.JobPolicy.describe(): scalars and "settings"
        kept_run["policy"] = {k: _scalars(v) if k == "settings" else v for k, v in run["policy"].items()
                              if isinstance(k, str) and (v is None or type(v) in (int, str, bool)
                                                         or (k == "settings" and isinstance(v, dict)))}
    gone = value.get("images_removed") if isinstance(value.get("images_removed"), dict) else {}
    removed = {"at": _num(gone.get("at")), "why": _str(gone.get("why"))} if gone else None
    return {"version": _int(value.get("version")), "cluster": cluster, "job": job,
            "updated_at": _num(value.get("updated_at")), "epochs": epochs, "withdrawn": withdrawn,
            "failed_captures": failed, "note": _str(value.get("note")), "run": kept_run,
            "interval": interval_record(value.get("interval")),
            "images_removed": removed}


def _scalars(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(k, str) and (v is None or type(v) in (int, float, str, bool))}


def _failure(f: dict[str, Any]) -> bool:
    """A failed capture as fresh_start.CaptureFailure holds it (its fields and their types)."""
    return (set(f) == {"epoch", "at", "rank", "node", "final", "trigger", "stage", "reason", "seen_by"}
            and _int(f["epoch"]) is not None and _num(f["at"]) is not None and f["final"] in (True, False, None)
            and type(f["final"]) in (bool, type(None))
            and all(isinstance(f[k], str) for k in ("rank", "node", "trigger", "stage", "reason", "seen_by")))
