"""The capture's record: what one rank's capture found, as the restore reads it back (rank.json), typed and
versioned (docs/architecture.md, "The capture's record").

A capture's stages fill a `Draft` section by section (rank/capture.py, rank/images.py); the record is built
whole from it when the images go to the store (`Capture`), and the store adds its seal (`Seal`: which rank,
which files, when and where written) to make the `RankRecord` that rank.json holds. The restore, the agent
and the tools read rank.json only through `RankRecord.from_json`.

Why in store/: the store writes and reads rank.json (seal, verify, unpack), and rank/, agent/ and cli/ stand
on the store; store/ may import nothing above it (tests/unit/project/test_layout.py). The module itself imports only
slurmckpt.errors. The coordinator does not read it (coordinator/budget.py takes the timings it is given).

On disk the layout is flat, one key per field, as every release wrote it; format 1 is that layout ("version":
1, also read when the key is missing). A record of a format this release does not know is refused with
StorageError, which a restore answers like any unreadable checkpoint: the previous epoch, then a fresh start.
A new format gets a new number and `from_json` keeps reading the old ones.

Entries whose shape belongs to one module are carried as that module's JSON and read only by it: the GPU
driver's record (cuda/stage.py), the /dev/shm files saved (rank/sharing/shm_files.py), the fingerprints of
files shared with other ranks (rank/sharing/ipc.py), TCP between ranks (rank/sharing/netlock.py) and to
other nodes (rank/sharing/crossnode.py), the listeners' ports (node/tcp_ports.py), the GPU host copy
(rank/host_copy.py); and the store's table of stored files (jobstore.py, persist.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from slurmckpt.errors import StorageError

FORMAT = 1                      # rank.json's layout; the key on disk is "version"
FORMATS_READ = (1,)
Json = dict[str, Any]


# ---- entries ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StdioFd:
    """One of the tree's root's fds 0-2: criu's key for what it names, handed in anew at the restore."""
    fd: int
    link: str
    key: str
    regular: bool
    size: int

    def to_json(self) -> Json:
        return {"fd": self.fd, "link": self.link, "key": self.key, "regular": self.regular, "size": self.size}

    @classmethod
    def from_json(cls, d: Json) -> StdioFd:
        return cls(int(d["fd"]), str(d["link"]), str(d["key"]), bool(d["regular"]), int(d["size"]))


@dataclass(frozen=True)
class WrittenFile:
    """A file the tree writes: cut back to `size` at the restore if it is still inode `ino`."""
    path: str
    size: int
    ino: int | None = None

    def to_json(self) -> Json:
        return {"path": self.path, "size": self.size, **({} if self.ino is None else {"ino": self.ino})}

    @classmethod
    def from_json(cls, d: Json) -> WrittenFile:
        return cls(str(d["path"]), int(d["size"]), None if d.get("ino") is None else int(d["ino"]))


@dataclass(frozen=True)
class ScriptFd:
    """The batch shell's fd(s) on its spooled script: criu key and file position."""
    key: str
    pos: int

    def to_json(self) -> Json:
        return {"key": self.key, "pos": self.pos}

    @classmethod
    def from_json(cls, d: Json) -> ScriptFd:
        return cls(str(d["key"]), int(d["pos"]))


@dataclass(frozen=True)
class HandedSocket:
    """A socket dumped as external (PMI, an srun stand-in's) and replaced at the restore."""
    key: str
    ino: int

    def to_json(self) -> Json:
        return {"key": self.key, "ino": self.ino}

    @classmethod
    def from_json(cls, d: Json) -> HandedSocket:
        return cls(str(d["key"]), int(d["ino"]))


@dataclass(frozen=True)
class GhostFile:
    """A deleted file the tree holds, which criu copies into its images."""
    path: str
    size: int
    how: str

    def to_json(self) -> Json:
        return {"path": self.path, "size": self.size, "how": self.how}

    @classmethod
    def from_json(cls, d: Json) -> GhostFile:
        return cls(str(d["path"]), int(d["size"]), str(d["how"]))


@dataclass(frozen=True)
class OutputSnapshot:
    """A task output file's data at the freeze (rank/output_snapshot.py); `ranges` None: from before they
    were kept, the snapshot holds every byte."""
    fd: int
    link: str
    size: int
    snapshot: str
    ranges: tuple[tuple[int, int], ...] | None

    def to_json(self) -> Json:
        return {"fd": self.fd, "link": self.link, "size": self.size, "snapshot": self.snapshot,
                **({} if self.ranges is None else {"ranges": [list(r) for r in self.ranges]})}

    @classmethod
    def from_json(cls, d: Json) -> OutputSnapshot:
        ranges = d.get("ranges")
        return cls(int(d["fd"]), str(d["link"]), int(d["size"]), str(d["snapshot"]),
                   None if ranges is None else tuple((int(a), int(b)) for a, b in ranges))


# ---- sections ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tree:
    """Which tree was captured, where and when. `kind` "replay": a batch step running srun, not imaged."""
    kind: str = "image"
    captured_at: float = 0.0       # frozen since PREPARE: the moment the images hold (store/handover.py)
    processes: int = 0
    node: str = ""
    uid: int = -1
    mntns: bool = False            # a GPU tree's own mount namespace
    step_token: str = ""           # a relayed srun's step name across restores (agent/plan.py); "": none

    @property
    def imaged(self) -> bool:
        return self.kind == "image"


@dataclass(frozen=True)
class Files:
    """Files the tree holds: stdio, what it writes (cut back), the batch script's position, deleted files,
    files mapped shared with other ranks (ipc.py's fingerprints) and /dev/shm files saved (shm_files.py)."""
    stdio: tuple[StdioFd, ...] = ()
    external: tuple[str, ...] = ()                 # criu keys dumped as external (handed in at the restore)
    truncate: tuple[WrittenFile, ...] = ()
    batch_script: tuple[ScriptFd, ...] = ()
    ghosts: tuple[GhostFile, ...] = ()
    shared: tuple[Json, ...] = ()                  # rank/sharing/ipc.py's
    shm: tuple[Json, ...] = ()                     # rank/sharing/shm_files.py's

    def shm_names(self) -> set[str]:
        """The /dev/shm names the capture saved (and the restore writes back)."""
        return {str(e["name"]) for e in self.shm}


@dataclass(frozen=True)
class Sockets:
    """Sockets handed over (PMI, srun stand-ins) and TCP: to other ranks of the node (netlock.py), to other
    nodes of the job (crossnode.py), to outside the job (restored closed: socket inodes), listeners
    (node/tcp_ports.py's)."""
    pmi: tuple[HandedSocket, ...] = ()
    srun_standins: tuple[HandedSocket, ...] = ()
    tcp_ranks: tuple[tuple[str, str, str, int], ...] = ()     # (local, remote, peer step, peer rank)
    tcp_nodes: tuple[tuple[str, str], ...] = ()               # (local, remote)
    tcp_close: tuple[int, ...] = ()
    tcp_ports: Json = field(default_factory=dict)  # node/tcp_ports.py's


@dataclass(frozen=True)
class Gpu:
    """The GPU driver's record (None: no CUDA process) and the host copy the capture saved itself."""
    state: Json | None = None                      # cuda/stage.py's
    host_copy: tuple[Json, ...] = ()               # rank/host_copy.py's


@dataclass(frozen=True)
class Capture:
    """What a capture's stages found, built whole once they ran (Draft.whole); with `timings` per stage and,
    for a final capture handed to its persister, the bytes it staged."""
    tree: Tree = Tree()
    files: Files = Files()
    sockets: Sockets = Sockets()
    gpu: Gpu = Gpu()
    outputs: tuple[OutputSnapshot, ...] = ()
    timings: Mapping[str, float] = field(default_factory=dict)
    staged_bytes: int | None = None

    def to_json(self) -> Json:
        t, f, s = self.tree, self.files, self.sockets
        out: Json = {
            "kind": t.kind, "captured_at": t.captured_at,
            "stdio": [e.to_json() for e in f.stdio], "mntns": t.mntns,
            "external_files": list(f.external), "truncate": [e.to_json() for e in f.truncate],
            "batch_script": [e.to_json() for e in f.batch_script],
            "processes": t.processes, "node": t.node, "uid": t.uid, "gpu": self.gpu.state,
            "tcp_ranks": [list(e) for e in s.tcp_ranks], "shared_files": list(f.shared),
            "ghost_files": [e.to_json() for e in f.ghosts], "shm_files": list(f.shm),
            "pmi": [e.to_json() for e in s.pmi], "srun_standins": [e.to_json() for e in s.srun_standins],
            "tcp_ports": s.tcp_ports}
        if t.step_token:
            out["step_token"] = t.step_token
        if t.imaged:        # a replayed batch step records no TCP leaving the node
            out.update(tcp_nodes=[list(e) for e in s.tcp_nodes], tcp_close=list(s.tcp_close))
        if self.gpu.host_copy:
            out["host_copy"] = list(self.gpu.host_copy)
        out["outputs"] = [e.to_json() for e in self.outputs]
        if self.staged_bytes is not None:
            out.update(bytes=self.staged_bytes, raw_bytes=self.staged_bytes)
        out["timings"] = dict(self.timings)
        return out

    @classmethod
    def from_json(cls, d: Json) -> Capture:
        """Format 1 (every release so far): a key a capture did not write reads as empty."""
        try:
            return cls._v1(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StorageError(f"rank.json unreadable: {type(e).__name__}: {e}") from e

    @classmethod
    def _v1(cls, d: Json) -> Capture:
        tcp_ports = d.get("tcp_ports")
        if not isinstance(tcp_ports, dict):        # an older release named only the listening ports
            ports = d.get("tcp_listen")
            tcp_ports = {"listeners": [["0.0.0.0", p] for p in ports]} if isinstance(ports, list) else {}
        tree = Tree(str(d.get("kind", "image")), float(d.get("captured_at", 0.0)), int(d.get("processes", 0)),
                    str(d.get("node", "")), int(d.get("uid", -1)), bool(d.get("mntns", False)),
                    str(d.get("step_token", "")))
        files = Files(tuple(StdioFd.from_json(e) for e in d.get("stdio", [])),
                      tuple(str(k) for k in d.get("external_files", [])),
                      tuple(WrittenFile.from_json(e) for e in d.get("truncate", [])),
                      tuple(ScriptFd.from_json(e) for e in d.get("batch_script") or []),
                      tuple(GhostFile.from_json(e) for e in d.get("ghost_files", [])),
                      tuple(dict(e) for e in d.get("shared_files", [])),
                      tuple(dict(e) for e in d.get("shm_files", [])))
        sockets = Sockets(tuple(HandedSocket.from_json(e) for e in d.get("pmi", [])),
                          tuple(HandedSocket.from_json(e) for e in d.get("srun_standins", [])),
                          tuple((str(lo), str(re), str(step), int(rank))
                                for lo, re, step, rank in d.get("tcp_ranks", [])),
                          tuple((str(lo), str(re)) for lo, re in d.get("tcp_nodes", [])),
                          tuple(int(i) for i in d.get("tcp_close", [])), dict(tcp_ports))
        gpu = d.get("gpu")
        timings = d.get("timings")
        staged = d.get("bytes")
        return cls(tree, files, sockets, Gpu(None if gpu is None else dict(gpu),
                                             tuple(dict(e) for e in d.get("host_copy", []))),
                   tuple(OutputSnapshot.from_json(e) for e in d.get("outputs", [])),
                   {str(k): v for k, v in timings.items()} if isinstance(timings, dict) else {},
                   staged if type(staged) is int else None)


@dataclass(frozen=True)
class Seal:
    """The store's part (jobstore.py seal_rank): whose images, which stored files (the store's own table:
    codec, sizes, checksum, identity per file), written when and on which node."""
    job: int
    step: str
    rank: int
    epoch: int
    files: Mapping[str, Json]
    written_at: float = 0.0
    sealed_on: str = ""

    def stored_bytes(self) -> int:
        return sum(_count(f.get("size")) for f in self.files.values())

    def raw_bytes(self, compressed_only: bool = False) -> int:
        """The images' bytes unpacked (a file stored raw: its size); `compressed_only`: of the files that
        are unpacked at a restore (the others are linked)."""
        return sum(_count(f.get("raw_size", f.get("size"))) for f in self.files.values()
                   if not compressed_only or f.get("codec", "none") != "none")


def _count(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


@dataclass(frozen=True)
class RankRecord:
    """rank.json: the capture's record and the store's seal, of one format."""
    capture: Capture
    seal: Seal
    format: int = FORMAT

    def to_json(self) -> Json:
        s = self.seal
        return {**self.capture.to_json(), "version": self.format, "job": s.job, "step": s.step, "rank": s.rank,
                "epoch": s.epoch, "files": {k: dict(v) for k, v in s.files.items()}, "written_at": s.written_at,
                "sealed_on": s.sealed_on}

    @classmethod
    def from_json(cls, d: object) -> RankRecord:
        """Raises StorageError for what is not a rank record of a format this release reads."""
        if not isinstance(d, dict) or not isinstance(d.get("files"), dict):
            raise StorageError("rank.json unreadable: no list of files")
        version = d.get("version", 1)           # the first images had no version key: the same layout
        if version not in FORMATS_READ:
            raise StorageError(f"rank.json is of format {version!r}; this slurmckpt reads format(s) "
                               f"{', '.join(map(str, FORMATS_READ))}: the checkpoint cannot be restored by it")
        try:
            seal = Seal(int(d.get("job", 0)), str(d.get("step", "")), int(d.get("rank", 0)), int(d.get("epoch", 0)),
                        {str(k): dict(v) for k, v in d["files"].items()}, float(d.get("written_at", 0.0)),
                        str(d.get("sealed_on", "")))
        except (TypeError, ValueError) as e:
            raise StorageError(f"rank.json unreadable: {e}") from e
        return cls(Capture.from_json(d), seal, FORMAT)


@dataclass
class Draft:
    """A capture's record while its stages run (rank/context.py EpochState.record): each stage sets its own
    sections, typed; `whole` builds the record. `bytes`/`raw_bytes`: what the persist stored (or a final
    capture staged), for the agent's reply."""
    tree: Tree | None = None
    files: Files | None = None
    sockets: Sockets | None = None
    gpu: Json | None = None
    host_copy: tuple[Json, ...] = ()
    outputs: tuple[OutputSnapshot, ...] = ()
    bytes: int = 0
    raw_bytes: int = 0

    @property
    def imaged(self) -> bool:
        """Recorded, and not a replayed batch step (whose tree is not dumped)."""
        return self.tree is not None and self.tree.imaged

    def whole(self, timings: Mapping[str, float], staged_bytes: int | None = None) -> Capture:
        if self.tree is None or self.files is None or self.sockets is None:
            raise StorageError("the capture's record is incomplete: its record stage did not run")
        return Capture(self.tree, self.files, self.sockets, Gpu(self.gpu, self.host_copy), self.outputs,
                       dict(timings), staged_bytes)
