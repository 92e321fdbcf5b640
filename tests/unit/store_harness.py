"""A rank runner whose CRIU and task cgroup are stand-ins, storing for real: images are written by a fake
engine into staging, then persisted, committed, unpacked and compared byte for byte (the store's tests)."""
from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurmckpt.store.compression import Zstd
from slurmckpt.identity import TreeName
from slurmckpt.node.launch import Credentials
from slurmckpt.store.persist import Priority, materialize
from slurmckpt.identity import RankName
from slurmckpt.rank.context import RankContext
from slurmckpt.rank.runner import RankRunner
from slurmckpt.node.packet_filter import Iptables
from slurmckpt.rank.images import StorePolicy
from slurmckpt.store.space import Quotas
from slurmckpt.store.staging import Staging
from slurmckpt.store.jobstore import JobStore


def images(seed: int, kib: int = 64) -> dict[str, bytes]:
    """What criu would write: random pages (stored raw), compressible pages and small records."""
    rnd = random.Random(seed).randbytes(kib * 1024)
    text = b"".join(b"step %08d loss %d\n" % (i, (i * seed) % 97) for i in range(kib * 40))
    return {"pages-1.img": rnd, "pages-2.img": text, "core-1.img": b"core%d" % seed * 300,
            "inventory.img": b"inv%d" % seed}


@dataclass
class Tree:
    """A harmless child process standing in for the task's tree (its /proc is what the stages read)."""
    proc: subprocess.Popen = field(default_factory=lambda: subprocess.Popen(
        ["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Cgroup:
    """Stands in for the task's cgroup (task_cgroup.TaskCgroup) around the real process `procs`."""
    procs: Tree
    path: Path = Path("/nonexistent/7.batch.0.0")
    frozen: bool = False
    tree: TreeName = TreeName(7, "batch", 0, 0)

    def pids(self) -> list[int]:
        return [self.procs.proc.pid]

    def other_trees(self) -> dict:
        return {}

    def kill_all(self) -> None:
        pass

    def freeze(self) -> float:
        self.frozen = True
        return 0.0

    def thaw(self) -> None:
        self.frozen = False

    def state(self) -> str:
        return "FROZEN" if self.frozen else "THAWED"

    def add(self, pid: int) -> None:
        pass


class Gpu:
    def refusals(self, pids): return []
    def lock(self, pids): pass
    def unlock(self): pass
    def checkpoint(self): return None
    def resume(self): pass
    def stops_for_resume(self): return False
    def left_stopped(self, pids): pass
    def restore(self, record, pids): pass
    def check_restore(self, record): pass


@dataclass
class Engine:
    """Writes `files` as criu's dump would; a restore records what it read from the images directory."""
    files: dict[str, bytes]
    restored: dict[str, bytes] | None = None
    restored_from: Path | None = None

    def dump(self, pid, images, *, leave_running, freezer, ghost_limit=0, external=None, link_remap=False,
             mntns=False, inherited_devices=(), leave_stopped=False, skip_pages=()) -> float:
        for name, data in self.files.items():
            (images / name).write_bytes(data)
        (images / "dump.log").write_text("criu dump log\n")
        return 0.0

    def restore(self, images, inherit, *, freezer, pidfile=None, join=None, tcp_close=(), mntns=False, leave_stopped=False) -> int:
        self.restored_from = images
        self.restored = {p.name: p.read_bytes() for p in images.iterdir() if p.name.endswith(".img")}
        return os.getpid()


class InProcess:
    """Stands in for node/detach.spawn: a final capture's persister (final_persist.persist_handed, what
    `slurmckpt persist-final` runs) in a thread of this process, on this store and staging. `hold` keeps it
    from starting until set (a persist still running after the job ended)."""

    def __init__(self, store: JobStore, staging: Staging, hold: threading.Event | None = None) -> None:
        self.store, self.staging, self.hold = store, staging, hold
        self.started: list["InProcess.Handle"] = []

    class Handle:
        def __init__(self, thread: threading.Thread) -> None:
            self.thread, self.pid, self.ok = thread, os.getpid(), None
            self.killed = threading.Event()

        def poll(self) -> int | None:
            return None if self.thread.is_alive() else 0

        def kill(self) -> None:           # a persister killed before it ran persists nothing
            self.killed.set()

        def wait(self, timeout: float | None = None) -> int:      # as Popen.wait
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise subprocess.TimeoutExpired("persist-final", timeout or 0)
            return 0

    def __call__(self, argv: list[str], env: dict[str, str]) -> "InProcess.Handle":
        from slurmckpt.store.final_persist import persist_handed
        args = dict(zip(argv[4::2], argv[5::2]))
        assert argv[3] == "persist-final" and args["--job"] == str(self.store.job), argv
        # the persister is told where the agent's own package lies (an agent not run from a venv)
        assert (Path(env["PYTHONPATH"]) / "slurmckpt" / "__init__.py").is_file(), env

        def run() -> None:
            while self.hold is not None and not self.hold.wait(0.02):
                if handle.killed.is_set():
                    return
            handle.ok = persist_handed(self.store, self.staging, int(args["--epoch"]), args["--step"],
                                       int(args["--rank"]))
        handle = InProcess.Handle(threading.Thread(target=run, daemon=True))
        handle.thread.start()
        self.started.append(handle)
        return handle


def rank_runner(store: JobStore, staging: Staging, tree: Tree, files: dict[str, bytes], step: str = "batch",
                quotas: Quotas = Quotas()) -> RankRunner:
    """A rank runner holding the context the agent would build for `tree` (rank/context.py)."""
    creds = Credentials(os.getuid(), os.getgid(), (), ())
    policy = StorePolicy(staging, Zstd(1, 1), Priority(), quotas, spawn=InProcess(store, staging))
    runner = RankRunner()
    runner.started(RankContext(store, RankName(step, 0), Cgroup(tree), Engine(files), Gpu(), creds, policy, Iptables(),
                               tree.proc.pid, root_pid=tree.proc.pid))
    return runner


def capture(p: RankRunner, epoch: int, final: bool = False, keep: int = 2) -> dict:
    """One epoch as the coordinator drives it, committed."""
    p.prepare(epoch)
    p.capture(epoch, final=final)
    if not final:
        p.resume(epoch)
    assert p.ctx is not None
    return p.ctx.store.commit(epoch, {f"{p.ctx.step}.0": {"kind": "image"}}, "test", keep=keep)


def read_back(store: JobStore, epoch: int, where: Path, step: str = "batch") -> dict[str, bytes]:
    """The committed rank's images as a restore gets them (verified while unpacked)."""
    where.mkdir(parents=True, exist_ok=True)
    for old in where.iterdir():
        old.unlink()
    materialize(store, epoch, step, 0, where)
    return {p.name: p.read_bytes() for p in where.iterdir()}


def settled(staging: Staging) -> list[Path]:
    """Staging areas and trash once background deletions are done (they run in threads)."""
    deadline = time.monotonic() + 5
    while (staging.areas() or list(staging.root.glob(".trash-*"))) and time.monotonic() < deadline:
        time.sleep(0.01)
    return staging.areas()


def leftovers(root: Path) -> list[str]:
    """Temp files anywhere under `root` (a writer that failed must remove its own)."""
    return [str(p) for p in root.rglob("*") if ".tmp." in p.name]
