"""What one rank's stages work on: `RankContext`, built whole by the agent once the task's tree exists (or is
about to be restored) and frozen from then on, and the state of one epoch: `CaptureState`, what a capture
found and did (capture.py), or `RestoreState`, what a restore of a committed epoch found (restore.py), both
an `EpochState`, what the engine keeps of any table's run (engine.py) and where the epoch stands (`Phase`).
A stage reads the context and writes only the state it is typed on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Self, TYPE_CHECKING

from slurmckpt.identity import RankName
from slurmckpt.store.space import CopyBudget
from slurmckpt.store.record import Draft, RankRecord

if TYPE_CHECKING:
    from concurrent.futures import Future
    from slurmckpt.criu.driver import CheckpointEngine, InheritedFd
    from slurmckpt.cuda.interface import RankGpu
    from slurmckpt.node.detach import Detached
    from slurmckpt.node.launch import Credentials
    from slurmckpt.node.packet_filter import PacketFilter
    from slurmckpt.node.task_cgroup import TaskCgroup
    from slurmckpt.rank.engine import Stage
    from slurmckpt.rank.fit import Footprint
    from slurmckpt.rank.images import StorePolicy
    from slurmckpt.rank.sharing.crossnode import Hold
    from slurmckpt.rank.sharing.rendezvous import RestoreKey
    from slurmckpt.store.jobstore import JobStore


@dataclass
class Handovers:
    """Sockets the wrapper handed over for its tree, known by inode: the task's PMI socket to slurmstepd
    (slurm/pmi.py) and the srun stand-ins' sockets to the batch wrapper (task/srun_relay.py). Both are dumped
    as external and replaced at a restore. Stand-ins connect while the tree runs, so the set grows."""
    pmi_fd: int = -1           # this start's PMI socket (srun --mpi=pmi2), else -1
    pmi_ino: int = 0
    standin_inos: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Limits:
    stall_after: tuple[str, float] | None = None       # Config.debug_stall_after (tests only)
    ghost_limit_max: int = 256 << 20                    # Config.ghost_limit_max (ghost.py)
    memory_ledger: Path | None = None    # Config.gpu_capture_memory_raise: where raises are recorded; None: off
    host_copy_threads: int = 8                          # Config.host_copy_threads (host_copy.py); 0: criu's
    tcp_hold_max: int = 1024                            # Config.tcp_hold_max (checks.py, netlock.py)


def _no_addresses() -> set[str]:
    return set()


@dataclass(frozen=True)
class RankContext:
    store: JobStore
    name: RankName                     # the step may be one a relayed srun took over (agent, plan)
    cgroup: TaskCgroup                 # the tree's, where Slurm placed it (node/task_cgroup.py)
    criu: CheckpointEngine
    gpu: RankGpu
    creds: Credentials                 # the task's, read from its wrapper
    policy: StorePolicy                # staging, compression, persist priority, quotas (images.py)
    packets: PacketFilter              # holds TCP between ranks while one end is restored
    wrapper_pid: int
    handovers: Handovers = field(default_factory=Handovers)
    limits: Limits = Limits()
    root_pid: int | None = None        # the tree's root; None while a restore brings it back
    standin_fds: tuple[int, ...] = ()  # a restore: new stand-in sockets whose other ends the new wrapper holds
    step_token: str = ""               # a relayed srun's step: its name across restores (agent, plan)
    # IP addresses of the job's other nodes (asked of Slurm once, when a capture first finds TCP leaving)
    job_addresses: Callable[[], set[str]] = _no_addresses
    peer_alive: Callable[[], bool] | None = None       # the wrapper is still the process wrapper_pid names

    @property
    def step(self) -> str:
        return self.name.step

    @property
    def rank(self) -> int:
        return self.name.rank


class Phase(Enum):
    """Where one rank's epoch stands. The engine sets a table's phases (engine.Table: `running`, then
    `reached` once every stage is done; `ROLLED_BACK` after the undos); the runner the others. The runner
    decides by it what CAPTURE, RESUME and ABORT may do (runner.py)."""
    SIZED = "sized"                  # SIZE measured the tree; nothing is held
    PREPARING = "preparing"
    PREPARED = "prepared"            # locked, GPU-checkpointed, frozen: CAPTURE may come
    CAPTURING = "capturing"
    CAPTURED = "captured"            # periodic: dumped into staging, the tree still frozen: RESUME persists it
    HANDED_OVER = "handed-over"      # final: dumped, its persister owns the images
    RESUMING = "resuming"            # RESUME gives the tree back: nothing of the epoch is undone any more
    RESUMED = "resumed"
    PERSISTING = "persisting"
    PERSISTED = "persisted"
    ROLLED_BACK = "rolled-back"      # the undos of the stages done ran (a failed stage, or ABORT)
    FINISHED = "finished"            # a final capture's tree killed (FINISH)
    RESTORING = "restoring"
    RESTORED = "restored"


# The epoch holds the task's tree (its undos are what ABORT runs); in any other phase ABORT drops its images.
HOLDING = frozenset({Phase.PREPARING, Phase.PREPARED, Phase.CAPTURING, Phase.CAPTURED, Phase.HANDED_OVER})


@dataclass
class EpochState:
    """What a capture and a restore of one epoch of one rank both have: what the engine keeps of the tables
    it ran over it (engine.py) and where the epoch stands."""
    epoch: int
    replay: bool = False       # batch step with srun running: replayed on restore, so never frozen or imaged
    phase: Phase = Phase.SIZED
    done: list[Stage[Self]] = field(default_factory=list)      # the stages done, for the rollback
    timings: dict[str, float] = field(default_factory=dict)
    failed_stage: str = ""                                # the stage that raised (set by stage_failed only)

    def stage_failed(self, stage: str) -> None:
        """The one writer of `failed_stage`: the stage that raised last in this epoch (a table's stage: the
        engine; SIZE and the final window: the runner; PERSIST: images.py), "" as a phase begins
        (store/fresh_start.py). The agent's error reply and the recorded capture failure name it."""
        self.failed_stage = stage


@dataclass
class CaptureState(EpochState):
    """One epoch of one rank, from SIZE (or PREPARE) to COMMIT or ABORT."""
    final: bool = False
    record: Draft = field(default_factory=Draft)          # what this epoch captured, by section (-> rank.json)
    footprint: Footprint | None = None                    # SIZE's measure (fit.py)
    gpu_record: dict[str, Any] | None = None
    tcp_peers: list[Any] = field(default_factory=list)        # (local, remote, peer step, peer rank), PREPARE
    shared_files: list[Any] = field(default_factory=list)     # files mapped shared with other ranks, PREPARE
    tcp_outside: dict[int, bool] = field(default_factory=dict)      # socket inode -> to another node of the job?, PREPARE
    # bytes this epoch may copy from the user's files (PREPARE's count, images.reserve; store/space.py)
    copy_budget: CopyBudget = field(default_factory=lambda: CopyBudget(0))
    ghost_limit: int = 0                                  # criu --ghost-limit for this epoch's dump
    # the GPU checkpoint's host copy per process (PREPARE), and what CAPTURE copied of it for criu to skip
    host_copies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    skip_pages: list[tuple[int, int, int]] = field(default_factory=list)
    host_copying: Future[None] | None = None              # a periodic capture's copy, beside criu's dump
    memory_raised: list[Any] = field(default_factory=list)    # host_memory.Raise made for this capture
    persister: Detached | None = None                     # a final capture's, once handed over (images.hand_over)

    @property
    def holding(self) -> bool:
        """The epoch holds the tree: PREPARE or CAPTURE ran (or runs) and nothing gave it back yet."""
        return self.phase in HOLDING


@dataclass
class RestoreState(EpochState):
    """One restore of a committed epoch (restore.py): what each stage found for the next."""
    phase: Phase = Phase.RESTORING
    stdio: list[int] = field(default_factory=list)       # the new start's stdio fds (and batch script's)
    images: Path | None = None                            # the unpacked images
    manifest: RankRecord | None = None                    # the rank's rank.json, as verified
    key: RestoreKey | None = None                         # this restore of the job on this node
    inherit: list[InheritedFd] = field(default_factory=list)
    owned_fds: list[int] = field(default_factory=list)          # fds a stage opened for criu (closed after)
    hold: Hold | None = None                              # TCP to other nodes held until both ends are back
    held: list[Any] = field(default_factory=list)              # TCP between ranks of this node, held likewise
    pid: int | None = None                                # the restored root
