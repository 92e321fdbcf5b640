"""The tree the agent starts or restores for its task, and everything that acts on it (service.py routes the
operations here): its cgroup (placed with Slurm's), the watchdog that thaws it should the agent die, the
drivers that capture it, what the wrapper hands over for it, and the runner of its epochs' stage tables."""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from slurmckpt import rates, validate
from slurmckpt.agent.facts import TaskFacts
from slurmckpt.agent.job import message_epoch as _epoch
from slurmckpt.agent.plan import TaskPlan
from slurmckpt.coordinator import budget
from slurmckpt.criu.driver import CriuDriver
from slurmckpt.cuda import nccl
from slurmckpt.cuda.rank_stage import CudaRankGpu
from slurmckpt.errors import PermissionDenied, ProtocolError, SlurmckptError, StorageError
from slurmckpt.identity import RankName
from slurmckpt.node import host_memory, packet_filter, procfs, watchdog
from slurmckpt.node.launch import Credentials, init_home, spawn_tree
from slurmckpt.node.peer import Peer
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.rank import leftovers
from slurmckpt.rank.context import Handovers, Limits, RankContext
from slurmckpt.rank.images import StorePolicy
from slurmckpt.rank.runner import RankRunner
from slurmckpt.rank.sharing import ipc
from slurmckpt.slurm import pmi
from slurmckpt.slurm.control import other_node_addresses, this_node
from slurmckpt.store import durable, reclaim
from slurmckpt.store.fresh_start import reason_of

log = logging.getLogger("slurmckpt.agent")


class TaskTree:
    def __init__(self, facts: TaskFacts, plan: TaskPlan, peer: Peer, cgroup: TaskCgroup, watchdog_fd: int,
                 criu: CriuDriver, gpu: CudaRankGpu, packets: packet_filter.PacketFilter, limits: Limits,
                 store_policy: StorePolicy, ledger: Path | None = None) -> None:
        self.facts, self.plan, self.peer = facts, plan, peer
        self.wrapper_pid = peer.pid
        self.cgroup = cgroup                      # or Slurm's task cgroup, once placed (_place_with_slurm)
        self.watchdog_fd = watchdog_fd            # thaws the tree if this agent dies with it frozen
        self.criu, self.gpu, self.packets, self.limits = criu, gpu, packets, limits
        self.store_policy = store_policy          # staging, compression, quotas (rank/images.py)
        self.ledger = ledger                      # memory limits raised for a capture (host_memory.py)
        self.handovers = Handovers()              # what the wrapper hands over for the tree (rank/context.py)
        self.runner = RankRunner()
        self._node_addresses: set[str] | None = None

    @classmethod
    def start(cls, facts: TaskFacts, plan: TaskPlan, peer: Peer, store_policy: StorePolicy) -> TaskTree:
        """The tree's cgroup, its watchdog and its drivers, from root's config; then this task's leftovers
        from earlier runs are reclaimed."""
        config, ident = facts.config, facts.ident
        cgroup = TaskCgroup.for_task(config.freezer_root, ident.tree)
        # memory limits raised for a capture are recorded here (host_memory.py), put back by the watchdog too
        ledger = host_memory.ledger_path(config.run_dir, str(ident.tree)) if config.gpu_capture_memory_raise \
            else None
        # Root alone writes the freeze control; the watchdog thaws the tree if this agent dies with it frozen.
        watchdog_fd = watchdog.start(cgroup, config.capture_timeout_s + 120, ledger=ledger)
        lock = packet_filter.method(config.network_lock)      # iptables, or nftables where it is missing
        # the drivers of every tree this task runs (rank/context.py: the agent builds each tree's context)
        criu = CriuDriver(config.criu_path, config.criu_extra_args, config.capture_timeout_s, network_lock=lock)
        gpu = CudaRankGpu(config.gpu_lock_timeout_ms,
                          context={"job": ident.job, "step": ident.step, "rank": ident.rank})
        limits = Limits(config.stall(), config.ghost_limit_max, ledger, config.host_copy_threads, config.tcp_hold_max)
        tree = cls(facts, plan, peer, cgroup, watchdog_fd, criu, gpu, packet_filter.for_method(lock), limits,
                   store_policy, ledger)
        collect_garbage(facts, store_policy)
        return tree

    def _other_node_addresses(self) -> set[str]:
        """The job's other nodes' addresses (asked once, when a capture first finds TCP leaving the node)."""
        if self._node_addresses is None:
            job = self.facts.slurm_job
            nodes = list(job.nodes) if job else []
            self._node_addresses = other_node_addresses(nodes, socket.gethostname()) if len(nodes) > 1 else set()
        return self._node_addresses

    def _task_credentials(self) -> Credentials:
        """Read when needed: at agent start the task has not yet dropped to the job's user."""
        creds = Credentials.of_process(self.peer.require(), self.facts.ident.uid)
        self.peer.require()            # what was read is the wrapper's, not a process that reused its pid
        return creds

    def _context(self, creds: Credentials, root_pid: int | None, standin_fds: tuple[int, ...] = ()) -> RankContext:
        """The context of the tree this task now runs or restores, built whole (rank/context.py)."""
        return RankContext(self.facts.store, RankName(self.plan.step, self.facts.ident.rank), self.cgroup,
                           self.criu, self.gpu, creds, self.store_policy, self.packets, self.wrapper_pid,
                           self.handovers, self.limits, root_pid, standin_fds, self.plan.step_token,
                           self._other_node_addresses, self.peer.alive)

    # ---- operations ------------------------------------------------------------------------------------
    def launch(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.runner.root_pid:
            raise PermissionDenied("a tree was already started for this task")
        argv, env, cwd, allow_io_uring = validate.launch(m, len(fds))
        ident, config = self.facts.ident, self.facts.config
        if ident.step == "batch" and ident.restart_count and self.plan.restored is None:
            self.plan.fresh_start_notice()      # said (AdminComment) even if the wrapper did not ask
        # CUDA refuses to work in a PID namespace that sees the host's /proc: a GPU tree gets a mount
        # namespace too, with its own /proc, which criu dumps and restores (docs/gpu.md, "Own PID namespace").
        # A GPU tree is one Slurm allocated GPUs to on this node, whatever the request's environment says.
        node, allocated = self._slurm_gpus_here()
        own_mntns = bool(allocated)
        creds = self._task_credentials()
        self._place_with_slurm()
        # io_uring, which criu cannot dump, blocked in the tree unless the site or the job (its own tree's
        # checkpointability, nothing else) said otherwise (docs/gpu.md, "io_uring").
        block_io_uring = config.block_io_uring and not allow_io_uring
        pid = spawn_tree(argv, env, cwd, fds, creds, config.init_path, self.cgroup,
                         init_home(config.run_dir, self.facts.task_name, creds), own_mntns,
                         block_io_uring=block_io_uring)
        self.runner.started(self._context(creds, pid))
        log.info("launched %s as pid %d (%s: Slurm allocated GPUs %s on %s; io_uring %s)", argv[0], pid,
                 "own mount namespace" if own_mntns else "no mount namespace of its own", allocated, node,
                 "blocked" if block_io_uring else "allowed")
        # the NCCL trade, told from what the task was started with and Slurm's GPUs here (cuda/nccl.py)
        in_job = argv[:2] == [config.cuda_checkpoint_launch, "--launch-job"]
        trade = nccl.describe(env, len(allocated), node, in_job)
        if trade and self.facts.events:
            self.facts.events.gpu_transports(trade)
        return {"pid": pid}

    def _place_with_slurm(self) -> None:
        """The tree goes where Slurm put the task (its step/task cgroups, read from the wrapper now that
        slurmstepd has placed it), and into our freeze cgroup: Slurm keeps tracking, limiting and
        accounting it (task_cgroup.py)."""
        placed = self.cgroup.placed_with_slurm(self.peer.require())
        self.peer.require()
        if placed.helpers is not None and placed is not self.cgroup:
            # Pure v2: the tree's cgroup is Slurm's task cgroup itself; wrapper and agent leave it for
            # slurmstepd's, and a new watchdog (forked there) watches it instead of our own cgroup.
            placed.move_helpers([self.wrapper_pid, os.getpid()])
            self.peer.require()
            os.close(self.watchdog_fd)
            self.cgroup.remove()
            self.watchdog_fd = watchdog.start(placed, self.facts.config.capture_timeout_s + 120, ledger=self.ledger)
        self.cgroup = placed
        log.info("tree cgroups: %s + %s", ", ".join(str(p.parent) for p in self.cgroup.slurm_procs) or "-",
                 self.cgroup.path)

    def pmi_socket(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The task's PMI socket to slurmstepd (`srun --mpi=pmi2`, pmi.py): dumped as external, replaced at
        the restore by this start's. Only the fd's own type is trusted; it goes into the user's tree only."""
        if len(fds) != 1:
            raise ProtocolError("pmi_socket needs the task's PMI fd")
        ino = pmi.require_unix_stream(fds[0])
        if self.handovers.pmi_fd >= 0:
            os.close(self.handovers.pmi_fd)
        self.handovers.pmi_fd, self.handovers.pmi_ino = os.dup(fds[0]), ino
        return {"ino": ino}

    def srun_standin(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """An srun stand-in's socket to the wrapper (srun_relay.py): dumped as external, replaced at the
        restore. Only the fd's type and inode are read; the agent keeps no reference to it."""
        if len(fds) != 1:
            raise ProtocolError("srun_standin needs the stand-in's socket")
        ino = pmi.require_unix_stream(fds[0])
        self.handovers.standin_inos.add(ino)
        return {"ino": ino}

    def tree_fate(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Asked by the wrapper when its tree has ended: whether this agent killed it, and why."""
        return {"killed_for": self.runner.killed_for}

    def restore(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        store, config, events = self.facts.store, self.facts.config, self.facts.events
        durable.await_store(store.root, config.store_wait_s)   # a shared file system's server restarting
        why_not = self.plan.not_restorable()
        if why_not is not None or not any(e["epoch"] == _epoch(m) for e in store.committed()):
            raise StorageError(why_not or f"epoch {_epoch(m)} is not a committed checkpoint of this job")
        if self.runner.root_pid:
            raise PermissionDenied("a tree is already running for this task")
        standins = m.get("standins", 0)
        if not (type(standins) is int and 0 <= standins <= len(fds) - 3 and len(fds) - standins in (3, 4)):
            raise ProtocolError("restore needs the 3 stdio fds (and the batch script's, for a batch step), then "
                                "one socket per srun stand-in")
        fds, handed = fds[:len(fds) - standins], tuple(fds[len(fds) - standins:])
        creds = self._task_credentials()
        init_home(config.run_dir, self.facts.task_name, creds)
        self._place_with_slurm()
        self.gpu.visible_devices, self.gpu.device_order = self._allocated_gpus()
        start = time.monotonic()
        try:
            pid, manifest = self.runner.restore(self._context(creds, None, handed), _epoch(m), fds)
        except Exception as e:
            self.facts.failures().restore_failed(_epoch(m), e)     # the reason if the task starts afresh
            if events:
                events.restore_failed(_epoch(m), reason_of(e))
            raise
        self.plan.restored_from(_epoch(m))
        log.info("restored epoch %d as pid %s in %.3fs", _epoch(m), pid, time.monotonic() - start)
        if events:
            events.restored(_epoch(m), time.monotonic() - start)
        return {"pid": pid, "kind": manifest.capture.tree.kind, "seconds": time.monotonic() - start}

    # ---- what the phases and the agent's end ask of the tree ----------------------------------------------
    def follow_size(self) -> None:
        """criu's timeout and the watchdog's frozen limit follow this epoch's bytes: root's own backstops,
        from root's own measurement (the coordinator's phase timeouts, from every rank's, abort earlier). The
        job's other trees on this node are taken to be as large: they dump to the same disk at once."""
        fp = self.runner.footprint
        if fp is None:
            return
        trees = 1 + len({name for name in ipc.job_trees(self.cgroup.other_trees(), self.facts.ident.job).values()})
        estimate = budget.Estimate.of([budget.RankSize(str(i), "this node", fp.host_bytes, fp.gpu_bytes,
                                                       len(fp.gpu.held)) for i in range(trees)])
        capture_s = max(self.facts.config.capture_timeout_s, rates.SAFETY * (estimate.dump + estimate.seal))
        self.criu.timeout_s = capture_s
        watchdog.set_limit(self.watchdog_fd, capture_s + 120)

    def end(self) -> None:
        """Wrapper gone. Whatever of the tree is left would escape Slurm's tracking (its subreaper died):
        end it, and never leave anything frozen."""
        try:
            self.cgroup.kill_all()
        except OSError:
            pass
        self.cgroup.remove()

    def _allocated_gpus(self) -> tuple[str, str]:
        """The GPUs this task restores onto: Slurm's allocation of the job on this node (indices in gres.conf
        File= order, i.e. /dev/nvidiaN order = PCI bus order), never the wrapper's environment. A step that
        narrows them with CUDA_VISIBLE_DEVICES to allocated indices keeps its narrowing; any other value is
        ignored (a user naming a GPU of another job changes nothing)."""
        node, allocated = self._slurm_gpus_here()
        claimed = procfs.environ(self.wrapper_pid).get("CUDA_VISIBLE_DEVICES", "")
        items = [s.strip() for s in claimed.split(",") if s.strip()]
        narrowed = bool(items) and all(s.isdigit() and int(s) in allocated for s in items) \
            and len(set(items)) == len(items)
        chosen = [int(s) for s in items] if narrowed else allocated
        log.info("GPUs for restore from Slurm's allocation on %s: %s; used: %s (wrapper's CUDA_VISIBLE_DEVICES "
                 "%r %s)", node, allocated, chosen, claimed[:64], "narrows it" if narrowed else "not used")
        return ",".join(str(i) for i in chosen), "PCI_BUS_ID"

    def _slurm_gpus_here(self) -> tuple[str, list[int]]:
        """(this node's name, the GPU indices Slurm allocated to the job on it); none when Slurm could not
        be asked."""
        gpus = self.facts.slurm_job.gpus if self.facts.slurm_job else {}
        node = this_node(sorted(gpus), socket.gethostname()) or socket.gethostname()
        return node, gpus.get(node, [])


def collect_garbage(facts: TaskFacts, store_policy: StorePolicy) -> None:
    """This job's dead epochs, this node's orphaned staging areas and this task's leftover cgroups
    (reclaim.py, leftovers.py): never fatal."""
    try:
        for r in (reclaim.collect_job(facts.store) + reclaim.collect_staging(store_policy.staging) +
                  leftovers.collect_task_cgroups(facts.config.freezer_root, facts.ident.tree)):
            log.info("reclaimed %s (%d bytes): %s", r.path, r.bytes, r.why)
    except (OSError, SlurmckptError) as e:
        log.warning("garbage collection at start failed: %s", e)
