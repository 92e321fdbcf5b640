"""One task's cgroup: where its tree lives, how it is frozen, thawed and killed, and which of Slurm's cgroups
the tree stays in. Every rank of an epoch is frozen before any rank is dumped.

Where the tree goes (chosen once, when the agent places it: `placed_with_slurm`):
- hybrid hosts (v1 controllers, v2 mounted at /sys/fs/cgroup/unified, as Slurm's cgroup/v1 runs): the
  tree joins `unified/slurmckpt/<tree>` as its freeze cgroup and stays in every v1 cgroup of the task, so
  Slurm's proctrack/cgroup, task/cgroup and jobacct_gather/cgroup keep tracking, limiting and accounting
  it; Slurm's own suspend (v1 freezer) is independent of ours, and a frozen tree still dies of SIGKILL (v2
  frozen tasks do; v1 frozen ones do not until thawed);
- pure v1: `/sys/fs/cgroup/freezer/slurmckpt/<tree>` (the tree then leaves Slurm's v1 freezer cgroup:
  docs/limitations.md);
- pure v2 with Slurm's cgroup/v2 plugin: Slurm's task cgroup itself. Slurm's layout is
  `<job>/<step>/{slurm,user/<task>}` below its own root (22.05 to 26.05; the job cgroup is `job_<id>`
  before 26.05 and named by SLUID since: nothing here reads a name). proctrack/cgroup lists, signals and
  waits for the pids of `<step>/slurm` and of each task cgroup itself, not of cgroups below them
  (`cgroup_p_step_get_pids`), so the tree stays in the task cgroup, which becomes its freeze cgroup
  (`cgroup.freeze` works in any v2 cgroup; Slurm's suspend freezes `<step>/user`, an ancestor: the two
  compose), and the wrapper, the agent and its watchdog move to slurmstepd's `<step>/slurm`, which Slurm
  lists and signals too. A root-only xattr labels the task cgroup with the tree's name;
- pure v2 without a Slurm task cgroup (proctrack/linuxproc, task/none): `/sys/fs/cgroup/slurmckpt/<tree>`.
criu is given the same path with --freeze-cgroup: it finds the tree already frozen and leaves it frozen
after the dump, so the coordinator decides when it thaws (RESUME) or dies (final capture).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from slurmckpt.node import procfs
from slurmckpt.errors import CaptureError
from slurmckpt.identity import TreeName

log = logging.getLogger("slurmckpt.cgroup")

CGROUP_FS = Path("/sys/fs/cgroup")
V1_ROOT = CGROUP_FS / "freezer"
UNIFIED = CGROUP_FS / "unified"
LABEL = "trusted.slurmckpt.task"      # the tree name on a Slurm task cgroup (root-only xattr)


def default_root() -> Path:
    """Where our own task cgroups live on this host (see the module docstring)."""
    if _is_cgroup2(UNIFIED):
        return UNIFIED / "slurmckpt"
    if _is_cgroup2(CGROUP_FS):
        return CGROUP_FS / "slurmckpt"
    return V1_ROOT / "slurmckpt"


def _is_cgroup2(path: Path) -> bool:
    try:
        return any(line.split(" - ")[1].startswith("cgroup2 ") and line.split()[4] == str(path)
                   for line in procfs.mountinfo() if " - " in line)
    except OSError:
        return False


def cgroup_mounts() -> dict[str, Path]:
    """controllers (as /proc/PID/cgroup names them; "0::" for v2) -> mount point."""
    out: dict[str, Path] = {}
    for line in procfs.mountinfo():
        fields, _, tail = line.partition(" - ")
        fstype, _source, options = (tail.split() + ["", "", ""])[:3]
        if fstype == "cgroup2":
            out.setdefault("0::", Path(fields.split()[4]))
        elif fstype == "cgroup":
            names = [o for o in options.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev",
                                                               "noexec", "clone_children")]
            out.setdefault(",".join(names), Path(fields.split()[4]))
    return out


def slurm_cgroups(pid: int, job: int) -> tuple[Path, ...]:
    """The cgroup.procs files of `pid`'s cgroups that belong to Slurm's job `job` (every v1 hierarchy, and
    v2 where it is Slurm's): a new process placed there is tracked, limited and accounted by Slurm like the
    task itself. The agent is forked before slurmstepd places the task in its step and task cgroups, so the
    tree must be put there explicitly (v1 moves no children)."""
    found = []
    mounts = cgroup_mounts()
    for _, controllers, path in procfs.cgroups(pid):
        if not _slurm_step_path(path, job):
            continue
        mount = mounts.get(controllers or "0::")
        if mount is not None:
            found.append(mount / path.lstrip("/") / "cgroup.procs")
    return tuple(found)


def _slurm_step_path(path: str, job: int) -> bool:
    """A cgroup of Slurm's job `job` below one of its steps: `.../job_<id>/step_<x>/...`, or since 26.05
    `.../<SLUID>/step_<x>/...` (the job component then names no job id: the step component decides)."""
    parts = path.split("/")
    steps = [i for i, part in enumerate(parts) if part.startswith("step_")]
    if not steps or steps[0] == 0:
        return False
    job_part = parts[steps[0] - 1]
    return job_part == f"job_{job}" or not job_part.startswith("job_")


@dataclass(frozen=True)
class SlurmV2Placement:
    task: Path       # Slurm's task cgroup of the wrapper: the tree's cgroup and freeze cgroup
    stepd: Path      # slurmstepd's cgroup of the same step: the wrapper, agent and watchdog go here


def find_slurm_v2(wrapper_pid: int, mount: Path) -> SlurmV2Placement | None:
    """Slurm's task cgroup of the wrapper and slurmstepd's cgroup of its step, or None where the wrapper
    is in no Slurm task cgroup. Checked, not taken on trust: the wrapper's parent is a root process
    (slurmstepd) whose cgroup is the sibling of the task cgroup's parent (`<step>/slurm` next to
    `<step>/user`), and both of those directories are root's. Slurm chowns the task cgroup itself to the
    job's user (who may create cgroups below it), but a user cannot create a directory in root's
    `<step>/user`, so a path of that shape is Slurm's."""
    try:
        rel = procfs.cgroup_v2(wrapper_pid)
        ppid = int(procfs.status(wrapper_pid)["PPid"][0])
        stepd_rel = procfs.cgroup_v2(ppid) if ppid > 0 else None
        stepd_uid = int(procfs.status(ppid)["Uid"][0]) if ppid > 0 else -1
    except (OSError, ValueError, KeyError, IndexError):
        return None
    if not rel or not stepd_rel or stepd_uid != 0 or rel == "/" or ".." in rel.split("/"):
        return None
    task, stepd = mount / rel.lstrip("/"), mount / stepd_rel.lstrip("/")
    if task.parent.parent != stepd.parent or task.parent == stepd or task.parent.parent == mount:
        log.info("wrapper's cgroup %s is no Slurm task cgroup next to slurmstepd's %s", rel, stepd_rel)
        return None
    try:
        if any(os.stat(d, follow_symlinks=False).st_uid != 0 for d in (task.parent, stepd)) or not task.is_dir():
            return None
    except OSError:
        return None
    return SlurmV2Placement(task, stepd)


def _label_of(cgroup: Path) -> TreeName | None:
    try:
        return TreeName.parse(os.getxattr(cgroup, LABEL).decode())
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class TaskCgroup:
    path: Path
    tree: TreeName
    slurm_procs: tuple[Path, ...] = ()     # Slurm's cgroups of the task (slurm_cgroups), joined first
    owned: bool = True                     # False: Slurm's task cgroup (pure v2), never rmdir'd by us
    helpers: Path | None = None            # pure v2: slurmstepd's cgroup.procs, for wrapper/agent/watchdog

    @classmethod
    def for_task(cls, root: str, tree: TreeName) -> TaskCgroup:
        """Our own cgroup for the tree (root: the config's freezer_root, "auto" = default_root())."""
        base = default_root() if root == "auto" else Path(root)
        base.mkdir(parents=True, exist_ok=True)
        path = base / str(tree)
        path.mkdir(exist_ok=True)
        return cls(path, tree)

    @classmethod
    def all_ours(cls, root: str) -> list[TaskCgroup]:
        """Every cgroup of ours on this host named like a task's tree (not Slurm's task cgroups)."""
        base = default_root() if root == "auto" else Path(root)
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        return [cls(base / n, tree) for n in names if (tree := TreeName.parse(n)) and (base / n).is_dir()]

    @classmethod
    def earlier_runs(cls, root: str, tree: TreeName) -> list[TaskCgroup]:
        """Our cgroups of this same task from earlier starts of the job (a lower restart count). Their
        agent and its watchdog can both die in slurmstepd's final SIGKILL before they remove them; Slurm
        never runs two starts of one job at once, so whatever is left of them is a leftover."""
        return [c for c in cls.all_ours(root) if c.tree.task == tree.task and c.tree.restart < tree.restart]

    @property
    def v1(self) -> bool:
        return (self.path / "freezer.state").exists()

    # ---- placement ----
    def placed_with_slurm(self, wrapper_pid: int) -> TaskCgroup:
        """Where the tree of the task whose wrapper is `wrapper_pid` goes. Pure v2 with Slurm's task cgroup:
        that cgroup itself (the caller moves the wrapper, agent and watchdog to `helpers` first, see
        move_helpers); otherwise this cgroup, placing new processes also in the Slurm cgroups the wrapper
        is in."""
        if not self.owned:
            return self                                                          # already placed
        mount = self.path.parent.parent
        if mount != UNIFIED and (mount / "cgroup.controllers").is_file():     # pure v2
            placed = find_slurm_v2(wrapper_pid, mount)
            if placed is not None:
                return TaskCgroup(placed.task, self.tree, (), owned=False, helpers=placed.stepd / "cgroup.procs")
        own = [p for p in slurm_cgroups(wrapper_pid, self.tree.job) if not p.is_relative_to(self.path.parent)]
        return TaskCgroup(self.path, self.tree, tuple(own))

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
                where = procfs.cgroup_v2(pid)
            except OSError:
                continue
            if where and str(self.path).endswith(where):
                self.helpers.write_text(str(pid))
        try:
            os.setxattr(self.path, LABEL, str(self.tree).encode())
        except OSError as e:
            log.warning("cannot label %s as %s (%s): the job's other trees on this node will not see it",
                        self.path, self.tree, e.strerror)

    def add(self, pid: int) -> None:
        """Put `pid` in the task's Slurm cgroups, then in the freeze cgroup."""
        for procs in self.slurm_procs:
            if procs.parent != self.path:
                procs.write_text(str(pid))
        (self.path / "cgroup.procs").write_text(str(pid))

    def other_trees(self) -> dict[int, TreeName]:
        """pid -> tree of every process of the node's other checkpointed trees: the sibling cgroups of our
        own cgroup, or on pure v2 (where trees are in Slurm's task cgroups) the job's labelled task cgroups
        (every `<step>/user/<task>` below the job cgroup, three levels up)."""
        found: list[tuple[Path, TreeName]] = []
        try:
            if self.owned:
                found = [(d, name) for d in self.path.parent.iterdir()
                         if d.is_dir() and d != self.path and (name := TreeName.parse(d.name))]
            else:
                job = self.path.parent.parent.parent
                found = [(t, name) for s in job.iterdir() if s.is_dir() for u in s.iterdir() if u.is_dir()
                         for t in u.iterdir() if t.is_dir() and t != self.path and (name := _label_of(t))]
        except OSError:
            pass
        out: dict[int, TreeName] = {}
        for d, name in found:
            try:
                out.update({int(x): name for x in (d / "cgroup.procs").read_text().split()})
            except (OSError, ValueError):
                continue
        return out

    # ---- freeze, thaw, kill ----
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
        return "frozen 1" in (self.path / "cgroup.events").read_text()

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
