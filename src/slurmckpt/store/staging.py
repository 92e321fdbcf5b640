"""The node-local staging area (docs/storage.md, "Staging"): where a capture dumps (so the freeze ends before
the bytes reach the shared store) and where a restore unpacks compressed images before CRIU reads them.

Root-only: the directory must be root's, mode 0700, and no symlink; it is never a path a user names.
Layout: <staging>/<cluster>.<job>/<purpose>-<epoch>-<step>.<rank>/ with `.owner` (which agent made it: a
node-local GC removes areas whose agent is gone) and `.reserve` (bytes the capture expects to write).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

from slurmckpt import validate
from slurmckpt.store.durable import atomic_write_json, posix_lock
from slurmckpt.errors import StorageError
from slurmckpt.store.jobstore import rank_name, tree_bytes

OWNER = ".owner"
AREA_RESERVE = ".reserve"            # in a staging area: the bytes its capture reserved (store/space.py)
TRASH = ".trash-"
MAKING_S = 60        # an area is made, then its .owner written: a younger area without one is being made


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Staging:
    root: Path
    cap: int = 0                 # bytes all areas together may hold (0: only the file system's free space)

    def ensure(self) -> None:
        """Made root-only if missing; refused if it exists as anything else (a user could read images)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise StorageError(f"staging directory {self.root} is not a directory owned by root "
                               "(key 'staging_dir')")
        if st.st_mode & 0o077:
            os.chmod(self.root, 0o700)

    def job_dir(self, cluster: str, job: int) -> Path:
        return self.root / f"{validate.label(cluster, 'cluster')}.{int(job)}"

    def area(self, cluster: str, job: int, purpose: str, epoch: int, step: str, rank: int) -> Path:
        return self.job_dir(cluster, job) / f"{purpose}-{validate.epoch(epoch):06d}-{rank_name(step, rank)}"

    def lock(self) -> ContextManager[None]:
        return posix_lock(self.root / ".lock", what="staging lock")

    def make(self, area: Path, reserve: int = 0) -> Path:
        """A fresh, empty area (leftovers of an earlier try of the same epoch go first)."""
        self.ensure()
        if area.exists():
            self.remove(area, wait=True)
        for attempt in range(5):       # another rank's cleanup may remove the (empty) job directory meanwhile
            try:
                area.parent.mkdir(mode=0o700, exist_ok=True)
                area.mkdir(mode=0o700)
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        (area / OWNER).write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}))
        if reserve:
            (area / AREA_RESERVE).write_text(str(int(reserve)))
        return area

    def hand_to(self, area: Path, pid: int) -> None:
        """Another root process owns `area` from now on (a final capture's persister: it outlives the agent
        that made the area, and the node's gc keeps the area while that process lives)."""
        atomic_write_json(area / OWNER, {"pid": pid, "start": _start_time(pid)})     # never read half-written

    def remove(self, area: Path, wait: bool = False) -> None:
        """Renamed away at once, deleted in the background (never on the path of a freeze)."""
        trash = self.root / f"{TRASH}{area.name}-{time.time_ns()}"
        try:
            os.rename(area, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = area
        if wait:
            shutil.rmtree(trash, ignore_errors=True)
        else:
            threading.Thread(target=shutil.rmtree, args=(trash, True), name="staging-cleanup", daemon=True).start()
        try:
            area.parent.rmdir()          # the job's directory, once it holds nothing
        except OSError:
            pass

    def areas(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [a for j in self.root.iterdir() if j.is_dir() and not j.name.startswith(".")
                for a in j.iterdir() if a.is_dir()]

    def usage(self) -> int:
        """Bytes the areas hold or have reserved (the larger of the two, per area)."""
        total = 0
        for area in self.areas():
            try:
                reserved = int((area / AREA_RESERVE).read_text())
            except (OSError, ValueError):
                reserved = 0
            total += max(reserved, tree_bytes(area))
        return total

    def orphans(self, now: float | None = None) -> list[Path]:
        """Areas whose agent is gone (died, or its node rebooted), and trash not yet deleted. An area without
        a readable .owner is one only once it is MAKING_S old: another agent may be between its mkdir and
        the .owner write (taking it then failed that agent's restore)."""
        now = time.time() if now is None else now
        found = [p for p in self.root.glob(TRASH + "*")] if self.root.is_dir() else []
        for area in self.areas():
            try:
                owner = json.loads((area / OWNER).read_text())
            except (OSError, ValueError):
                try:
                    if now - os.lstat(area).st_mtime > MAKING_S:
                        found.append(area)
                except FileNotFoundError:
                    pass
                continue
            if _start_time(int(owner.get("pid", 0))) != owner.get("start"):
                found.append(area)
        return found
