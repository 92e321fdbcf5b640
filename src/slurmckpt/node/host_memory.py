"""How much more host memory a process may take before something gives: the node's MemAvailable, and the
memory cgroup limits above the process (Slurm's job, step or task cgroup with ConstrainRAMSpace); and, where
the site allows it, root's raise of Slurm's limits for one capture, put back after it.

Why a capture asks: the CUDA driver's checkpoint copies a process's device memory into fresh host memory of
that same process, charged to the process's memory cgroup; criu then writes the images through the page
cache, charged to the cgroup of the agent that runs it, which is inside the job's cgroup (slurmstepd's
`<step>/slurm`, task_cgroup.py). Past memory.max the OOM killer ends the job inside its capture; past
memory.high (Slurm sets it where it constrains RAM) the kernel throttles every process of the cgroup instead
(seen on the GPU machine: 16 GiB on the GPU with --mem=24G ran 104 s instead of 25 s and no capture
committed, nothing said why). A capture that does not fit is refused in SIZE, before anything is locked
(rank/fit.py; docs/gpu.md, "Host memory of a GPU capture").

Each limited level: limit = min(memory.max, memory.high) (v1: memory.limit_in_bytes), resident = usage less
its page cache (active_file + inactive_file: reclaimed first; shmem is not in it). cgroup v2: memory.max /
memory.high / memory.current / memory.stat; v1 (memory controller): memory.limit_in_bytes /
memory.memsw.limit_in_bytes / memory.usage_in_bytes / memory.stat (total_* counters).

The raise (config `gpu_capture_memory_raise`): only Slurm's own levels (root's directories from the job's
cgroup down), by what the capture adds to each, under a node-wide lock (ranks of one job on a node share its
cgroup: each adds and takes back its own amount), recorded in a root-only ledger per tree before the epoch
goes on. It is put back after the GPU restore (periodic), on every abort (the stage's undo), and by the
thaw watchdog when the agent is gone (node/watchdog.py). It always goes back: a job that holds more than its
own limit then is reclaimed or OOM-killed by the kernel as at any other time over its --mem (a raise kept
for it would let a job grow past its limit capture after capture). That the driver lets go of its host copy
at the GPU restore is what tests/gpu/nvml_probe.py checks. A tree's level raised and not yet put back is not
raised again.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from slurmckpt.node import procfs
from slurmckpt.node.task_cgroup import cgroup_mounts

log = logging.getLogger("slurmckpt.memory")

V1_UNLIMITED = 1 << 62       # v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 bytes)
LEDGER_DIR = "memory-raises"


@dataclass(frozen=True)
class Headroom:
    """One memory cgroup above a process that limits it."""
    bytes: int                    # what may still be added: limit - resident
    limit: int                    # the lowest limit of the level
    cgroup: str                   # its path in its hierarchy
    resident: int = 0             # charged to it now, less its page cache
    writer_inside: bool = False   # the agent (and the criu it runs) is charged here: so are the images' pages
    directory: str = ""           # where its files are on this host
    raisable: bool = False        # Slurm's own (root's, from the job's cgroup down): root may raise it
    files: tuple[str, ...] = ()   # its limit files, in the order a raise writes them (a lowering reverses it)


def node_available() -> int:
    """MemAvailable: what the kernel estimates can be allocated without swapping."""
    return procfs.meminfo()["MemAvailable"]


def levels(pid: int, writer: int | None = None) -> list[Headroom]:
    """Every memory cgroup above `pid` (itself included, up to the hierarchy's root) that has a limit;
    `writer`: the process whose writes go through the page cache (the agent), to tell which hold them."""
    try:
        lines = procfs.cgroups(pid)
        mounts = cgroup_mounts()
    except OSError:
        return []
    try:
        writer_lines = procfs.cgroups(writer) if writer else []
    except OSError:
        writer_lines = []
    v1 = next(((mounts.get(c), path) for _, c, path in lines if "memory" in c.split(",")), None)
    if v1 is not None and v1[0] is not None:
        writes = next((p for _, c, p in writer_lines if "memory" in c.split(",")), None)
        return _levels(v1[0], v1[1], writes, _V1Level)
    v2 = next((path for hier, c, path in lines if hier == "0" and not c), None)
    if v2 is not None and mounts.get("0::") is not None:
        writes = next((p for h, c, p in writer_lines if h == "0" and not c), None)
        return _levels(mounts["0::"], v2, writes, _V2Level)
    return []


def cgroup_headroom(pid: int, writer: int | None = None) -> Headroom | None:
    """The level that leaves the least room above `pid`, or None where no limit applies (or it is gone)."""
    return min(levels(pid, writer), key=lambda h: h.bytes, default=None)


def _levels(mount: Path, path: str, writes: str | None, read: type[_Reader]) -> list[Headroom]:
    out = []
    parts = [p for p in path.split("/") if p]
    steps = [i for i, part in enumerate(parts) if part.startswith("step_")]
    job_depth = steps[0] if steps else len(parts) + 1       # the job's cgroup: right above its first step
    for depth in range(len(parts), -1, -1):
        rel = "/" + "/".join(parts[:depth])
        found = read(mount / rel.lstrip("/"), rel).level(
            inside=writes is not None and (rel == "/" or writes == rel or writes.startswith(rel + "/")),
            slurms=depth >= job_depth)
        if found is not None:
            out.append(found)
    return out


class _Reader:
    def __init__(self, d: Path, rel: str) -> None:
        self.d, self.rel = d, rel

    def level(self, inside: bool, slurms: bool) -> Headroom | None:
        raise NotImplementedError

    def _made(self, limit: int, usage: int, cache: int, inside: bool, slurms: bool,
              files: tuple[str, ...]) -> Headroom:
        resident = max(0, usage - cache)
        return Headroom(max(0, limit - resident), limit, self.rel, resident, inside, str(self.d),
                        slurms and _roots(self.d), files)


class _V2Level(_Reader):
    def level(self, inside: bool, slurms: bool) -> Headroom | None:
        files = tuple(f for f in ("memory.max", "memory.high") if (_read(self.d / f) or "max") != "max")
        if not files:
            return None
        stat = _stat(self.d / "memory.stat")
        limit = min(int(_read(self.d / f) or 0) for f in files)
        return self._made(limit, int(_read(self.d / "memory.current") or 0),
                          stat.get("active_file", 0) + stat.get("inactive_file", 0), inside, slurms, files)


class _V1Level(_Reader):
    def level(self, inside: bool, slurms: bool) -> Headroom | None:
        limit = _read(self.d / "memory.limit_in_bytes")
        if limit is None or int(limit) >= V1_UNLIMITED:
            return None
        memsw = _read(self.d / "memory.memsw.limit_in_bytes")
        # memsw must stay >= the limit: raised first, lowered last
        files = (("memory.memsw.limit_in_bytes",) if memsw and int(memsw) < V1_UNLIMITED else ()) \
            + ("memory.limit_in_bytes",)
        stat = _stat(self.d / "memory.stat")
        return self._made(int(limit), int(_read(self.d / "memory.usage_in_bytes") or 0),
                          stat.get("total_active_file", 0) + stat.get("total_inactive_file", 0), inside, slurms,
                          files)


def _roots(d: Path) -> bool:
    try:
        return os.stat(d, follow_symlinks=False).st_uid == 0
    except OSError:
        return False


# ---- the raise -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Raise:
    """`by` bytes added to each of `files` in `directory` for one capture."""
    directory: str
    files: tuple[str, ...]
    by: int
    cgroup: str


def ledger_path(run_dir: str, tree: str) -> Path:
    return Path(run_dir) / LEDGER_DIR / f"{tree}.json"


def raise_limits(plan: list[tuple[Headroom, int]], ledger: Path) -> list[Raise]:
    """Raise each planned level by its amount; each raise is in the ledger before the next is made."""
    done: list[Raise] = []
    with _locked(ledger):
        pending = {r.directory for r in _read_ledger(ledger)}
        for level, by in plan:
            if not level.raisable or by <= 0 or level.directory in pending:
                continue
            for name in level.files:
                _add(Path(level.directory) / name, by)
            done.append(Raise(level.directory, level.files, by, level.cgroup))
            _write_ledger(ledger, _read_ledger(ledger) + [done[-1]])
            log.info("memory cgroup %s: limit raised by %d bytes for the capture", level.cgroup, by)
    return done


def put_back(raises: list[Raise], ledger: Path) -> list[str]:
    """Take each raise back (those of `raises` still in the ledger); a level left holding more than its own
    limit, one line each (the kernel reclaims or OOM-kills there, as at any time over the job's --mem)."""
    over = []
    with _locked(ledger):
        pending = _read_ledger(ledger)
        for r in [r for r in raises if r in pending]:
            over += _lower(r)
            pending.remove(r)
        _write_ledger(ledger, pending)
    return over


def put_back_all(ledger: Path) -> list[str]:
    """Every raise the ledger holds (the agent is gone, or ends): the thaw watchdog's act."""
    raises = _read_ledger(ledger)
    over = put_back(raises, ledger) if raises else []
    try:
        ledger.unlink()
    except OSError:
        pass
    return over


def _lower(r: Raise) -> list[str]:
    d = Path(r.directory)
    if not d.is_dir():
        return []                               # the job's cgroup is gone, and its limit with it
    reader = _V1Level if "memory.limit_in_bytes" in r.files else _V2Level
    level = reader(d, r.cgroup).level(inside=False, slurms=False)
    for name in reversed(r.files):
        _add(d / name, -r.by)
    log.info("memory cgroup %s: limit put back (-%d bytes)", r.cgroup, r.by)
    if level is not None and level.resident > level.limit - r.by:
        return [f"memory cgroup {r.cgroup}: the job holds {level.resident} bytes there after the capture, more than "
                f"its own limit of {level.limit - r.by}, to which it went back"]
    return []


def _add(path: Path, by: int) -> None:
    value = (_read(path) or "max")
    if value == "max" or int(value) >= V1_UNLIMITED:
        return
    path.write_text(str(max(0, int(value) + by)))


class _locked:
    """The node's lock on every memory raise (ranks of one job on the node raise the same cgroups), and the
    ledger's root-only directory, made and checked (not a link, root's, 0700) before it is used."""

    def __init__(self, ledger: Path) -> None:
        self.ledger = ledger

    def __enter__(self) -> None:
        d = self.ledger.parent
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{d} is not a private directory of this user")
        self.fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _read_ledger(ledger: Path) -> list[Raise]:
    try:
        entries = json.loads(ledger.read_text())
    except (FileNotFoundError, ValueError):
        return []
    out = []
    for e in entries if isinstance(entries, list) else []:
        try:
            out.append(Raise(str(e["directory"]), tuple(str(f) for f in e["files"]), int(e["by"]), str(e["cgroup"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _write_ledger(ledger: Path, raises: list[Raise]) -> None:
    tmp = ledger.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in raises]))
    os.replace(tmp, ledger)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out
