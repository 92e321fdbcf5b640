"""cgroup freezer for one task's tree: every rank of an epoch is frozen before any rank is dumped.

The freeze cgroup is a cgroup v2 one wherever the kernel offers v2 (`cgroup.freeze`, `cgroup.kill`):
- hybrid hosts (v1 controllers, v2 mounted at /sys/fs/cgroup/unified, as Slurm's cgroup/v1 runs): the
  tree joins `unified/slurmckpt/<task>` and only that; its v1 memberships stay Slurm's, so Slurm's
  proctrack/cgroup, task/cgroup and jobacct_gather/cgroup keep tracking, limiting and accounting it,
  Slurm's own suspend (v1 freezer) is independent of ours, and a frozen tree still dies of SIGKILL (v2
  frozen tasks do; v1 frozen ones do not until thawed);
- pure v1: `/sys/fs/cgroup/freezer/slurmckpt/<task>` (the tree then leaves Slurm's v1 freezer cgroup:
  docs/limitations.md);
- pure v2 with Slurm's cgroup/v2 plugin: Slurm's task cgroup itself (slurm_v2.py: Slurm lists and signals
  only the pids of its task cgroups, not of their children); the wrapper, agent and watchdog move to
  slurmstepd's cgroup of the step; without a Slurm task cgroup (proctrack/linuxproc, task/none):
  `/sys/fs/cgroup/slurmckpt/<task>`.
criu is given the same path with --freeze-cgroup: it finds the tree already frozen and leaves it frozen
after the dump, so the coordinator decides when it thaws (RESUME) or dies (final capture).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from slurmckpt import slurm_v2
from slurmckpt.errors import CaptureError

CGROUP_FS = Path("/sys/fs/cgroup")
V1_ROOT = CGROUP_FS / "freezer"
UNIFIED = CGROUP_FS / "unified"
CGROUP2_MAGIC = 0x63677270


def default_root() -> Path:
    """Where task freeze cgroups live on this host (see the module docstring)."""
    if _is_cgroup2(UNIFIED):
        return UNIFIED / "slurmckpt"
    if _is_cgroup2(CGROUP_FS):
        return CGROUP_FS / "slurmckpt"
    return V1_ROOT / "slurmckpt"


def _is_cgroup2(path: Path) -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split(" - ")[1].startswith("cgroup2 ") and line.split()[4] == str(path)
                       for line in f if " - " in line)
    except OSError:
        return False


def slurm_cgroups(pid: int, job: int, proc: Path = Path("/proc")) -> tuple[Path, ...]:
    """The cgroup.procs files of `pid`'s cgroups that belong to Slurm's job `job` (every v1 hierarchy, and
    v2 where it is Slurm's), from /proc/PID/cgroup: a new process placed there is tracked, limited and
    accounted by Slurm like the task itself. The agent is forked before slurmstepd places the task in its
    step and task cgroups, so the tree must be put there explicitly (v1 moves no children)."""
    found = []
    with open(proc / str(pid) / "cgroup") as f:
        lines = f.read().splitlines()
    mounts = _cgroup_mounts()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if f"/job_{job}/" not in path + "/":
            continue
        mount = mounts.get(controllers or "0::")
        if mount is not None:
            found.append(mount / path.lstrip("/") / "cgroup.procs")
    return tuple(found)


def _cgroup_mounts() -> dict[str, Path]:
    """controllers (as /proc/PID/cgroup names them; "0::" for v2) -> mount point."""
    out: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, tail = line.partition(" - ")
            fstype, _source, options = (tail.split() + ["", "", ""])[:3]
            if fstype == "cgroup2":
                out.setdefault("0::", Path(fields.split()[4]))
            elif fstype == "cgroup":
                names = [o for o in options.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev",
                                                                   "noexec", "clone_children")]
                out.setdefault(",".join(names), Path(fields.split()[4]))
    return out


@dataclass(frozen=True)
class Freezer:
    path: Path
    slurm_procs: tuple[Path, ...] = ()     # Slurm's cgroups of the task (slurm_cgroups), joined first
    label: str = ""                        # job.step.rank.restart; "" = the directory's name
    owned: bool = True                     # False: Slurm's task cgroup (pure v2), never rmdir'd by us
    helpers: Path | None = None            # pure v2: slurmstepd's cgroup.procs, for wrapper/agent/watchdog

    @property
    def name(self) -> str:
        """The tree's name, job.step.rank.restart (agent.py), wherever its cgroup is."""
        return self.label or self.path.name

    @classmethod
    def for_task(cls, root: str, name: str) -> "Freezer":
        base = default_root() if root == "auto" else Path(root)
        base.mkdir(parents=True, exist_ok=True)
        path = base / name
        path.mkdir(exist_ok=True)
        return cls(path)

    @property
    def v1(self) -> bool:
        return (self.path / "freezer.state").exists()

    def add(self, pid: int) -> None:
        """Put `pid` in the task's Slurm cgroups, then in the freeze cgroup."""
        for procs in self.slurm_procs:
            if procs.parent != self.path:
                procs.write_text(str(pid))
        (self.path / "cgroup.procs").write_text(str(pid))

    def in_slurm_cgroups_of(self, pid: int, job: int, proc: Path = Path("/proc")) -> "Freezer":
        """Where the tree of the task whose wrapper is `pid` goes. Pure v2 with Slurm's task cgroup: that
        cgroup itself (the caller moves the wrapper, agent and watchdog to `helpers` first, see move_helpers);
        otherwise this freeze cgroup, placing new processes also in the Slurm cgroups the wrapper is in."""
        if not self.owned:
            return self                                                          # already placed
        mount = self.path.parent.parent
        if mount != UNIFIED and (mount / "cgroup.controllers").is_file():     # pure v2
            placed = slurm_v2.find(pid, mount, proc)
            if placed is not None:
                return Freezer(placed.task, (), self.name, owned=False, helpers=placed.stepd / "cgroup.procs")
        own = [p for p in slurm_cgroups(pid, job, proc) if not p.is_relative_to(self.path.parent)]
        return Freezer(self.path, tuple(own), self.label)

    def move_helpers(self, pids: list[int]) -> None:
        """Pure v2: move the wrapper, the agent and its watchdog out of the task cgroup into slurmstepd's
        (Slurm lists and signals both), so that freezing the task cgroup freezes the tree alone."""
        if self.helpers is None:
            return
        for pid in pids:
            self.helpers.write_text(str(pid))
        # Whatever else is in the task cgroup before the tree starts is the wrapper's (its coordinator
        # process): moved too, or freezing the tree would freeze the coordinator of the epoch. A pid is
        # moved only while /proc still shows it in the task cgroup (not a process that reused the number).
        for pid in self.pids():
            try:
                line = next((x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                             if x.startswith("0::")), "")
                if len(line) > 4 and str(self.path).endswith(line[3:]):
                    self.helpers.write_text(str(pid))
            except OSError:
                pass
        slurm_v2.label(self.path, self.name)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def state(self) -> str:
        if self.v1:
            return (self.path / "freezer.state").read_text().strip()
        return "FROZEN" if (self.path / "cgroup.freeze").read_text().strip() == "1" else "THAWED"

    def freeze(self, timeout_s: float = 10.0) -> float:
        start = time.monotonic()
        if self.v1:
            (self.path / "freezer.state").write_text("FROZEN")
        else:
            (self.path / "cgroup.freeze").write_text("1")
        while not self._settled_frozen():
            if time.monotonic() - start > timeout_s:
                self.thaw()
                raise CaptureError(f"tree did not freeze within {timeout_s}s", cgroup=str(self.path))
            time.sleep(0.002)
        return time.monotonic() - start

    def _settled_frozen(self) -> bool:
        if self.v1:
            return self.state() == "FROZEN"
        events = (self.path / "cgroup.events").read_text()
        return "frozen 1" in events

    @property
    def control(self) -> Path:
        return self.path / ("freezer.state" if self.v1 else "cgroup.freeze")

    def kill_all(self) -> None:
        """SIGKILL every process of the tree, none that is not in it: on v2 the kernel does it (cgroup.kill);
        on v1 the pids are read while the tree is frozen (a frozen process cannot exit, so no pid is reused
        between the read and the kill), then the thaw lets the kills land."""
        kill = self.path / "cgroup.kill"
        if not self.v1 and kill.exists():
            kill.write_text("1")
            return
        try:
            self.freeze()
        except CaptureError:
            pass                   # thawed again by freeze(): kill what is there, as well as it can be done
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.thaw()

    def thaw(self) -> None:
        if self.v1:
            (self.path / "freezer.state").write_text("THAWED")
        else:
            (self.path / "cgroup.freeze").write_text("0")

    def remove(self) -> None:
        """Thaw, and rmdir the cgroup if it is ours (Slurm removes its own task cgroup)."""
        try:
            self.thaw()
        except OSError:
            pass
        if not self.owned:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
