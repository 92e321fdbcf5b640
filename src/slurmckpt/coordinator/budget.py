"""An epoch's budget, from what every rank measured in the SIZE phase (rank/fit.py): whether the GPU copies
of ranks that share a node or a memory cgroup fit together, and how long each phase may take.

Timeouts follow the bytes at the rates measured on the H200 (rates.py; docs/gpu.md, "Rates"), times SAFETY,
with the configured values as floors. Ranks of one node run each phase at once and share the node's copy
engines and disk, so each phase takes the longest of: the slowest rank alone, and the node's total at the
node's rate. A rank checkpoints its own CUDA processes one after the other (one process per driver call).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from slurmckpt import validate
from slurmckpt.errors import ProtocolError
from slurmckpt.rates import (CRIU_DUMP_BPS, GPU_CALL_S, GPU_CHECKPOINT_BPS, GPU_CHECKPOINT_NODE_BPS, GPU_RESTORE_BPS,
                             GPU_RESTORE_NODE_BPS, NODE_WRITE_BPS, SAFETY, SEAL_BPS)
from slurmckpt.sizes import size_text

FREEZE_S = 10.0                     # the cgroup freeze's own limit (task_cgroup.TaskCgroup.freeze)
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


# ---- the final capture inside the window Slurm gives (docs/operations.md, "The time Slurm gives") ----------
# What must end before Slurm's SIGKILL: a rank's PREPARE and CAPTURE until its images are complete in the
# node's staging (rank/capture.py), the persister handed the images (a root process outside the job's
# cgroups), and the coordinator's hand-over record. Persist, seal and commit come after the SIGKILL.
# (every stage of PREPARE and PERIODIC_CAPTURE, rank/capture.py; tests/unit hold them equal)
FINAL_STAGES = ("check", "pmi-precheck", "space", "memory", "gpu-lock", "gpu-checkpoint", "freeze", "pmi-idle",
                "drain-output", "record", "host-copy", "dump", "snapshot-output")
# the ones whose time follows the bytes: the driver's copy to the host, slurmckpt's copy of it into the
# images, criu's dump of the rest (without host-copy a 17.5 GiB final capture was judged to need ~10 s and
# took 19-20 s on the H200)
BYTE_STAGES = ("gpu-checkpoint", "host-copy", "dump")
# Too small a margin and a capture dies half-written at the SIGKILL (said at the restore, but lost); too large
# and one that would have fit is skipped. The periodic captures it is measured on ran the same stages.
FINAL_MARGIN = 1.15      # a final capture's path as measured (or rated), times this
FINAL_TAIL_S = 1.0       # round trips of SIZE, PREPARE and CAPTURE, the hand-over, the tree's kill
MIN_MEASURED_BYTES = 64 << 20    # below this a measured rate says more about fixed costs than about bytes


@dataclass(frozen=True)
class MeasuredCapture:
    """One earlier capture of a rank (its rank.json): its images' raw bytes and the seconds its final path's
    stages took, split into those that follow the bytes and the rest."""
    epoch: int
    nbytes: int
    byte_s: float
    fixed_s: float

    def path_s(self, size: RankSize) -> float:
        """Seconds of `size`'s path at this capture's rate."""
        if self.nbytes >= MIN_MEASURED_BYTES:
            return self.fixed_s + self.byte_s * size.image_bytes / self.nbytes
        return self.fixed_s + self.byte_s + _rated(RankSize(size.rank, size.node, max(0, size.image_bytes - self.nbytes)))

    def fits_bytes(self, window_s: float) -> int:
        """The most bytes whose final capture fits in `window_s` at this capture's rate (0: none)."""
        room = (window_s - FINAL_TAIL_S) / FINAL_MARGIN - self.fixed_s
        return int(room * self.nbytes / self.byte_s) if room > 0 and self.byte_s > 0 else 0

    @classmethod
    def from_timings(cls, epoch: int, nbytes: int, timings: dict[str, Any]) -> MeasuredCapture | None:
        """None when the record has no stage timings (written before they were kept) or no bytes."""
        def seconds(name: str) -> float:
            value = timings.get(name, 0.0)
            return float(value) if isinstance(value, (int, float)) and 0 <= value < 1e6 else 0.0
        if nbytes <= 0 or not any(name in timings for name in BYTE_STAGES):
            return None
        byte_s = sum(seconds(n) for n in BYTE_STAGES)
        return cls(epoch, nbytes, byte_s, sum(seconds(n) for n in FINAL_STAGES) - byte_s)


@dataclass(frozen=True)
class FinalCost:
    seconds: float
    basis: str          # what the figure comes from, for the job's output and the admin


def final_capture_cost(size: RankSize, measured: MeasuredCapture | None) -> FinalCost:
    """Seconds one rank's final capture needs until its images are complete in staging: its last measured
    capture scaled to today's bytes, else the budget's rates (docs/gpu.md, "Rates"). A measured capture too
    small to tell a rate keeps its own seconds, and the bytes grown since go at the budget's rates."""
    if measured is not None:
        return FinalCost(round(measured.path_s(size) * FINAL_MARGIN + FINAL_TAIL_S, 1),
                         f"measured at epoch {measured.epoch}: {size_text(measured.nbytes)} into staging in "
                         f"{measured.fixed_s + measured.byte_s:.1f} s; {size_text(size.image_bytes)} now")
    return FinalCost(round(_rated(size) * FINAL_MARGIN + FINAL_TAIL_S, 1),
                     f"no capture of it measured yet: {size_text(size.image_bytes)} at {CRIU_DUMP_BPS / 1e9:.1f} GB/s "
                     f"dump" + (f", {GPU_CHECKPOINT_BPS / 1e9:.1f} GB/s GPU copy" if size.gpu_bytes else ""))


def _rated(size: RankSize) -> float:
    e = Estimate.of([size])
    return e.gpu_checkpoint + e.dump


@dataclass(frozen=True)
class WindowVerdict:
    fits: bool
    text: str            # why, in one line: what the final capture needs, what Slurm allows, what has passed


def judge_final(cost: FinalCost, allowed_s: float, allowed: str, elapsed_s: float) -> WindowVerdict:
    """Whether a final capture of `cost` fits in what is left of Slurm's window (`allowed_s`, described by
    `allowed`, `elapsed_s` of it gone since the SIGTERM)."""
    left = allowed_s - max(0.0, elapsed_s)
    text = (f"final capture needs ~{cost.seconds:.0f} s ({cost.basis}), Slurm allows {allowed}"
            + (f" and {elapsed_s:.1f} s of it have passed since the SIGTERM" if elapsed_s >= 0.05 else ""))
    return WindowVerdict(cost.seconds <= left, text)
