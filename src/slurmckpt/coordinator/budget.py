"""An epoch's budget, from what every rank measured in the SIZE phase (rank/fit.py): whether the GPU copies
of ranks that share a node or a memory cgroup fit together, and how long each phase may take.

Timeouts follow the bytes at the rates measured on the H200 (driver 580; docs/gpu.md, "Rates"), times
SAFETY, with the configured values as floors. Ranks of one node run each phase at once and share the node's
copy engines and disk, so each phase takes the longest of: the slowest rank alone, and the node's total at
the node's rate. A rank checkpoints its own CUDA processes one after the other (one process per driver call).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from slurmckpt import validate
from slurmckpt.errors import ProtocolError
from slurmckpt.sizes import size_text

GPU_CHECKPOINT_BPS = 2.0e9          # device -> host, one process (32 GiB: 15-18 s)
GPU_CHECKPOINT_NODE_BPS = 6.0e9     # all processes of a node at once (4 processes on one GPU)
GPU_RESTORE_BPS = 5.5e9             # host -> device, one process
GPU_RESTORE_NODE_BPS = 12.5e9
GPU_CALL_S = 0.5                    # fixed cost of one checkpoint or restore call
CRIU_DUMP_BPS = 1.0e9               # one tree's memory into its images
NODE_WRITE_BPS = 1.6e9              # a node's local disk, direct writes, all ranks at once
SEAL_BPS = 1.6e9                    # images read back and checksummed (xxh3 outruns the disk)
FREEZE_S = 10.0                     # the cgroup freeze's own limit (task_cgroup.TaskCgroup.freeze)
SAFETY = 2.0
ABORT_FLOOR_S = 30.0
MAX_BYTES = 2**62


@dataclass(frozen=True)
class RankSize:
    rank: str
    node: str
    host_bytes: int = 0
    gpu_bytes: int = 0
    gpu_processes: int = 0
    largest_process_bytes: int = 0
    mem_available: int = MAX_BYTES
    cgroup: str = ""                  # the tightest memory cgroup above its CUDA processes ("" none)
    cgroup_headroom: int = MAX_BYTES

    @property
    def image_bytes(self) -> int:
        return self.host_bytes + self.gpu_bytes

    @classmethod
    def from_reply(cls, rank: str, node: str, msg: dict[str, Any]) -> RankSize:
        """A `sized` reply, every field checked (the rank's wrapper is the job user's process)."""
        def size(name: str, default: int = 0) -> int:
            return validate.integer(msg.get(name, default), name, 0, MAX_BYTES)
        out = cls(rank, node, size("host_bytes"), size("gpu_bytes"),
                  validate.integer(msg.get("gpu_processes", 0), "gpu_processes", 0, validate.MAX_TASKS),
                  size("largest_process_bytes"), size("mem_available", MAX_BYTES),
                  validate.text(msg.get("cgroup", ""), "cgroup", 512), size("cgroup_headroom", MAX_BYTES))
        if out.largest_process_bytes > out.gpu_bytes:
            raise ProtocolError("bad sized reply: largest_process_bytes above gpu_bytes")
        return out


def _by(sizes: Iterable[RankSize], key: Callable[[RankSize], str]) -> dict[str, list[RankSize]]:
    groups: dict[str, list[RankSize]] = defaultdict(list)
    for s in sizes:
        groups[key(s)].append(s)
    return groups


def refusals(sizes: list[RankSize]) -> list[tuple[RankSize, str]]:
    """Ranks that fit alone (each rank checked itself) but not together: the GPU copies of every rank of a
    node against its MemAvailable, of ranks under one memory cgroup against its room. (first rank, why)."""
    out = []
    for node, ranks in sorted(_by(sizes, lambda s: s.node).items()):
        total, available = sum(r.gpu_bytes for r in ranks), min(r.mem_available for r in ranks)
        if len(ranks) > 1 and total > available:
            out.append((ranks[0], f"on node {node} the GPU checkpoints of ranks {_names(ranks)} copy {size_text(total)} "
                                  f"of device memory into host memory, the node has {size_text(available)} available "
                                  f"(MemAvailable): {size_text(total - available)} short"))
        for cgroup, members in sorted(_by([r for r in ranks if r.cgroup], lambda s: s.cgroup).items()):
            total, room = sum(r.gpu_bytes for r in members), min(r.cgroup_headroom for r in members)
            if len(members) > 1 and total > room:
                out.append((members[0], f"on node {node} the GPU checkpoints of ranks {_names(members)} copy "
                                        f"{size_text(total)} into memory cgroup {cgroup}, which has room for {size_text(room)}: "
                                        f"{size_text(total - room)} short; ask Slurm for more memory (--mem)"))
    return out


def _names(ranks: list[RankSize]) -> str:
    return ", ".join(r.rank for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


@dataclass(frozen=True)
class Estimate:
    """Seconds each piece of work takes on the slowest node, at the measured rates (no safety margin)."""
    gpu_checkpoint: float = 0.0
    dump: float = 0.0
    seal: float = 0.0
    gpu_restore: float = 0.0

    @classmethod
    def of(cls, sizes: list[RankSize]) -> Estimate:
        worst = cls()
        for ranks in _by(sizes, lambda s: s.node).values():
            calls = max(r.gpu_processes for r in ranks) * GPU_CALL_S
            gpu = sum(r.gpu_bytes for r in ranks)
            images = sum(r.image_bytes for r in ranks)
            node = cls(
                gpu_checkpoint=calls + max(max(r.gpu_bytes for r in ranks) / GPU_CHECKPOINT_BPS,
                                           gpu / GPU_CHECKPOINT_NODE_BPS),
                dump=max(max(r.image_bytes for r in ranks) / CRIU_DUMP_BPS, images / NODE_WRITE_BPS),
                seal=images / SEAL_BPS,
                gpu_restore=calls + max(max(r.gpu_bytes for r in ranks) / GPU_RESTORE_BPS,
                                        gpu / GPU_RESTORE_NODE_BPS))
            worst = cls(*(max(a, b) for a, b in zip(
                (worst.gpu_checkpoint, worst.dump, worst.seal, worst.gpu_restore),
                (node.gpu_checkpoint, node.dump, node.seal, node.gpu_restore))))
        return worst


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds the coordinator waits for every rank's answer to each phase, and the work behind them."""
    prepare: float
    capture: float
    resume: float
    estimate: Estimate = Estimate()

    @classmethod
    def derive(cls, sizes: list[RankSize], prepare_floor: float, capture_floor: float) -> PhaseTimeouts:
        """PREPARE: lock, GPU checkpoint, freeze. CAPTURE: dump and (final) seal. RESUME: thaw, GPU restore,
        seal (periodic). Each at least its configured floor."""
        e = Estimate.of(sizes)
        work = _work(e)
        return cls(round(max(prepare_floor, work["prepare"]), 1), round(max(capture_floor, work["capture"]), 1),
                   round(max(capture_floor, work["resume"]), 1), e)

    def abort_after(self, phase: str) -> float:
        """How long ranks may take to confirm an abort sent while `phase` was running: each rank's agent serves
        one request at a time, so a rank first ends its part of the phase (the work the sizes predict for it,
        not the floor) and then undoes it (a GPU restore at most)."""
        work = _work(self.estimate)
        return round(ABORT_FLOOR_S + work.get(phase, 0.0) + SAFETY * self.estimate.gpu_restore, 1)

    def as_dict(self) -> dict[str, float]:
        return {"prepare_s": self.prepare, "capture_s": self.capture, "resume_s": self.resume}


def _work(e: Estimate) -> dict[str, float]:
    freeze = FREEZE_S if e.gpu_checkpoint else 0.0      # without GPU work the floor covers lock and freeze
    return {"prepare": SAFETY * e.gpu_checkpoint + freeze, "capture": SAFETY * (e.dump + e.seal),
            "resume": SAFETY * (e.gpu_restore + e.seal)}
