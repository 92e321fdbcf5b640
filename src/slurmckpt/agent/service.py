"""The per-task privileged agent (root). Started by the SPANK shim in slurm_spank_task_init_privileged as a
child of the task, so job, step, rank and uid come from Slurm, not from the user.

It serves exactly one peer, the task's wrapper, over an inherited socket, and acts only on the tree it
started or restored itself and on this job's images: no request names a pid, a path or another job.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from slurmckpt.channel import Channel
from slurmckpt.config import Config
from slurmckpt.criu.driver import CriuDriver
from slurmckpt.errors import PermissionDenied, ProtocolError, SlurmckptError, StorageError
from slurmckpt.agent.events import AgentEvents
from slurmckpt.store.fresh_start import FailureReporter, reason_of
from slurmckpt.store.instance import JobInstance, claim
from slurmckpt.cuda import nccl
from slurmckpt.cuda.rank_stage import PipelineGpu
from slurmckpt.rank.sharing import ipc
from slurmckpt.slurm import pmi
from slurmckpt.store import durable
from slurmckpt.node import host_memory, packet_filter, watchdog
from slurmckpt.coordinator import budget
from slurmckpt.identity import TaskIdentity
from slurmckpt import validate
from slurmckpt.agent import window
from slurmckpt.agent.interruptions import PartitionHistory
from slurmckpt.node.launch import Credentials, init_home, spawn_tree
from slurmckpt.node.peer import Peer
from slurmckpt.identity import RankName
from slurmckpt.rank.context import Handovers, Limits, RankContext
from slurmckpt.rank.runner import RankRunner
from slurmckpt.policy import JobPolicy
from slurmckpt.rank.images import StorePolicy
from slurmckpt.store import reclaim
from slurmckpt.slurm.control import other_node_addresses
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.store.jobstore import JobStore, rank_name
from slurmckpt.node.task_cgroup import TaskCgroup
from slurmckpt.agent.job import message_epoch as _epoch
from slurmckpt.agent.plan import TaskPlan

log = logging.getLogger("slurmckpt.agent")

PHASE_OPS = ("size", "prepare", "capture", "resume")


class Agent(TaskPlan):
    restored: int | None = None          # the epoch this task restored (None: not restored)
    events: AgentEvents | None = None    # slurmd's log, metrics, the job's comment and summary (events.py)
    policy = JobPolicy()                 # the site policy for the job's partition and QOS (policy.py)
    interval_s = 0                       # the interval this task uses (the shim's, after the policy)
    last_periodic: float | None = None   # monotonic time of the last periodic capture's PREPARE
    prepared: tuple[int, bool, float] | None = None   # the last PREPARE let through: epoch, final, when
    store_outage: str | None = None      # the store did not answer at the start: waited (agent/start.py)
    store_wait_s = 120.0                 # Config.store_wait_s
    reporter: FailureReporter | None = None   # capture failures recorded and told (fresh_start.py)
    token_unmatched = False              # a relayed srun's step token that no committed epoch holds
    srun_relay: str | None = None        # the batch step: its wrapper's srun relay (srun_relay.py)
    history: PartitionHistory | None = None   # the partition's interruptions, once the coordinator asks
    final_window: window.FinalWindow | None = None    # the time Slurm gives a final capture (agent/start.py)
    limits = Limits()                    # Config.stall() (tests' pauses) and the ghost limit, set at start

    def __init__(self, ident: TaskIdentity, channel: Channel, config: Config, peer: Peer,
                 slurm_job: JobRecord | None = None, events: AgentEvents | None = None,
                 policy: JobPolicy = JobPolicy(), interval: tuple[int, bool] = (0, True)) -> None:
        """`interval`: the shim's seconds and whether the job asked for them (--checkpoint-interval) or they
        are the plugin's default_interval=, which the policy's default replaces."""
        self.ident, self.channel, self.config, self.peer = ident, channel, config, peer
        self.events, self.policy = events, policy
        self.interval_s = policy.interval(*interval)
        self.wrapper_pid = peer.pid
        self.store = JobStore(Path(config.storage_root), ident.cluster, ident.job)
        self.store.ensure()
        self.store_policy = StorePolicy.from_config(config)
        self.store_wait_s = config.store_wait_s   # staging, compression, quotas (rank/images.py)
        self.srun_relay = self._relay_path() if ident.step == "batch" else None
        # The job instance, from slurmctld by the trusted job id (instance.py); None: Slurm did not answer
        self.slurm_job = slurm_job
        self.instance = None if slurm_job is None else JobInstance(
            ident.cluster, ident.job, ident.uid, ident.gid, slurm_job.submit_time, ident.restart_count)
        self.store_note = claim(self.store, self.instance) if self.instance else None
        if self.store_note:
            log.warning("%s", self.store_note)
        # from now on no older run of the job commits (storage.py: a late commit of a run cut off by a requeue)
        try:
            run = self.store.enter_run(ident.restart_count)
            if run > ident.restart_count:
                log.warning("run %d of the job has started already: this run (%d) commits nothing", run,
                            ident.restart_count)
        except StorageError as e:       # this run's first commit enters it instead
            log.warning("cannot record run %d in the store: %s", ident.restart_count, e)
        self.cgroup = TaskCgroup.for_task(config.freezer_root, ident.tree)
        # memory limits raised for a capture are recorded here (host_memory.py), put back by the watchdog too
        self.ledger = host_memory.ledger_path(config.run_dir, str(ident.tree)) if config.gpu_capture_memory_raise \
            else None
        # Root alone writes the freeze control; the watchdog thaws the tree if this agent dies with it frozen.
        self.watchdog_fd = watchdog.start(self.cgroup, config.capture_timeout_s + 120, ledger=self.ledger)
        lock = packet_filter.method(config.network_lock)      # iptables, or nftables where it is missing
        # the drivers of every tree this task runs (rank/context.py: the agent builds each tree's context)
        self.criu = CriuDriver(config.criu_path, config.criu_extra_args, config.capture_timeout_s, network_lock=lock)
        self.gpu = PipelineGpu(config.gpu_lock_timeout_ms,
                               context={"job": ident.job, "step": ident.step, "rank": ident.rank})
        self.packets = packet_filter.for_method(lock)
        self.limits = Limits(config.stall(), config.ghost_limit_max, self.ledger, config.host_copy_threads,
                             config.tcp_hold_max)
        self.handovers = Handovers()              # what the wrapper hands over for the tree (rank/context.py)
        self.step = ident.step                   # or the step a relayed srun takes over (_adopt_step)
        self.step_token = ""
        self.runner = RankRunner()
        self._collect_garbage()
        self.reporter = FailureReporter(self.store, ident.job, rank_name(ident.step, ident.rank),
                                        socket.gethostname(), annotate=events.note if events else _no_note,
                                        on_recorded=events.capture_failed if events else None)

    def _other_node_addresses(self) -> set[str]:
        """The job's other nodes' addresses (asked once, when a capture first finds TCP leaving the node)."""
        if not hasattr(self, "_node_addresses"):
            nodes = list(self.slurm_job.nodes) if self.slurm_job else []
            self._node_addresses = other_node_addresses(nodes, socket.gethostname()) if len(nodes) > 1 else set()
        return self._node_addresses

    def _collect_garbage(self) -> None:
        """This job's dead epochs, this node's orphaned staging areas and this task's leftover cgroups
        (reclaim.py): never fatal."""
        try:
            for r in (reclaim.collect_job(self.store) + reclaim.collect_staging(self.store_policy.staging) +
                      reclaim.collect_task_cgroups(self.config.freezer_root, self.ident.tree)):
                log.info("reclaimed %s (%d bytes): %s", r.path, r.bytes, r.why)
        except (OSError, SlurmckptError) as e:
            log.warning("garbage collection at start failed: %s", e)

    def _task_credentials(self) -> Credentials:
        """Read when needed: at agent start the task has not yet dropped to the job's user."""
        creds = Credentials.of_process(self.peer.require(), self.ident.uid)
        self.peer.require()            # what was read is the wrapper's, not a process that reused its pid
        return creds

    def _context(self, creds: Credentials, root_pid: int | None, standin_fds: tuple[int, ...] = ()) -> RankContext:
        """The context of the tree this task now runs or restores, built whole (rank/context.py)."""
        return RankContext(self.store, RankName(self.step, self.ident.rank), self.cgroup, self.criu, self.gpu,
                           creds, self.store_policy, self.packets, self.wrapper_pid, self.handovers, self.limits,
                           root_pid, standin_fds, self.step_token, self._other_node_addresses, self.peer.alive)


    # ---- loop ----------------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                message, fds = self.channel.recv()
            except EOFError:
                break
            except ProtocolError as e:    # the stream can't be trusted any more: stop serving this peer
                log.warning("rejected frame, closing the channel: %s", e)
                self._reply_error(e)
                break
            try:
                self.peer.require()        # serve the wrapper, never a process that inherited its socket
                handler = getattr(self, "op_" + str(message.get("op")), None)
                if handler is None:
                    raise ProtocolError(f"unknown operation {message.get('op')!r}")
                reply = handler(message, fds) or {}
                self.channel.send({"ok": True, **reply})
            except SlurmckptError as e:
                log.error("%s failed: %s", message.get("op"), e)
                self._reply_error(e, self._failed_stage(message))
            except Exception as e:  # the agent boundary: report, never die with the tree frozen
                log.exception("%s crashed", message.get("op"))
                self._reply_error(SlurmckptError(f"{type(e).__name__}: {e}"), self._failed_stage(message))
            finally:
                for fd in fds:
                    os.close(fd)
        self.shutdown()

    def _reply_error(self, e: SlurmckptError, stage: str = "") -> None:
        try:
            self.channel.send({"ok": False, "error": str(e), "error_type": type(e).__name__,
                               **({"stage": stage} if stage else {})})
        except OSError:
            pass

    def _failed_stage(self, message: dict[str, Any]) -> str:
        """The stage that failed, for the epoch's phases (the coordinator's abort message names it)."""
        return self.runner.failed_stage if message.get("op") in PHASE_OPS else ""

    def shutdown(self) -> None:
        """Wrapper gone. Whatever of the tree is left would escape Slurm's tracking (its subreaper died):
        end it, and never leave anything frozen."""
        try:
            self.cgroup.kill_all()
        except OSError:
            pass
        self.cgroup.remove()
        if self.reporter:                  # its AdminComment may still be on its way to slurmctld
            self._failures().flush()
        if self.events:
            self.events.stopped()

    # ---- operations ------------------------------------------------------------------------------------
    def op_hello(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        i = self.ident
        return {"job": i.job, "step": i.step, "rank": i.rank, "cluster": i.cluster,
                "restart_count": i.restart_count, "node": socket.gethostname()}

    def _require_policy(self, epoch: int, final: bool) -> None:
        """A capture the site policy forbids is refused before anything is frozen."""
        since = None if self.last_periodic is None else time.monotonic() - self.last_periodic
        refused = self.policy.capture_refusal(final, since)
        if refused:
            if self.events:
                self.events.refused(*refused)
            raise PermissionDenied(f"{refused[1]}; nothing was frozen", epoch=epoch)

    def op_launch(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.runner.root_pid:
            raise PermissionDenied("a tree was already started for this task")
        argv, env, cwd, allow_io_uring = validate.launch(m, len(fds))
        if self.ident.step == "batch" and self.ident.restart_count and self.restored is None:
            self._fresh_start_notice()      # said (AdminComment) even if the wrapper did not ask
        # CUDA refuses to work in a PID namespace that sees the host's /proc: a GPU tree gets a mount
        # namespace too, with its own /proc, which criu dumps and restores (docs/gpu.md, "Own PID namespace").
        # A GPU tree is one Slurm allocated GPUs to on this node, whatever the request's environment says.
        node, allocated = self._slurm_gpus_here()
        own_mntns = bool(allocated)
        creds = self._task_credentials()
        self._place_with_slurm()
        # io_uring, which criu cannot dump, blocked in the tree unless the site or the job (its own tree's
        # checkpointability, nothing else) said otherwise (docs/gpu.md, "io_uring").
        block_io_uring = self.config.block_io_uring and not allow_io_uring
        pid = spawn_tree(argv, env, cwd, fds, creds, self.config.init_path, self.cgroup,
                         init_home(self.config.run_dir, self._task_name, creds), own_mntns,
                         block_io_uring=block_io_uring)
        self.runner.started(self._context(creds, pid))
        log.info("launched %s as pid %d (%s: Slurm allocated GPUs %s on %s; io_uring %s)", argv[0], pid,
                 "own mount namespace" if own_mntns else "no mount namespace of its own", allocated, node,
                 "blocked" if block_io_uring else "allowed")
        # the NCCL trade, told from what the task was started with and Slurm's GPUs here (cuda/nccl.py)
        in_job = argv[:2] == [self.config.cuda_checkpoint_launch, "--launch-job"]
        trade = nccl.describe(env, len(allocated), node, in_job)
        if trade and self.events:
            self.events.gpu_transports(trade)
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
            self.watchdog_fd = watchdog.start(placed, self.config.capture_timeout_s + 120, ledger=self.ledger)
        self.cgroup = placed
        log.info("tree cgroups: %s + %s", ", ".join(str(p.parent) for p in self.cgroup.slurm_procs) or "-",
                 self.cgroup.path)

    def op_pmi_socket(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The task's PMI socket to slurmstepd (`srun --mpi=pmi2`, pmi.py): dumped as external, replaced at
        the restore by this start's. Only the fd's own type is trusted; it goes into the user's tree only."""
        if len(fds) != 1:
            raise ProtocolError("pmi_socket needs the task's PMI fd")
        ino = pmi.require_unix_stream(fds[0])
        if self.handovers.pmi_fd >= 0:
            os.close(self.handovers.pmi_fd)
        self.handovers.pmi_fd, self.handovers.pmi_ino = os.dup(fds[0]), ino
        return {"ino": ino}

    def op_srun_standin(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """An srun stand-in's socket to the wrapper (srun_relay.py): dumped as external, replaced at the
        restore. Only the fd's type and inode are read; the agent keeps no reference to it."""
        if len(fds) != 1:
            raise ProtocolError("srun_standin needs the stand-in's socket")
        ino = pmi.require_unix_stream(fds[0])
        self.handovers.standin_inos.add(ino)
        return {"ino": ino}

    def op_tree_fate(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Asked by the wrapper when its tree has ended: whether this agent killed it, and why."""
        return {"killed_for": self.runner.killed_for}

    def op_size(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self._epoch_began(m)
        with self._failures().recorded(_epoch(m), "size", self.runner):
            reply = window.sized(self.runner, _epoch(m), m, self.final_window, self.store, self.step,
                                 self.ident.rank, self.limits)
        self._size_limits()
        return reply

    def _size_limits(self) -> None:
        """criu's timeout and the watchdog's frozen limit follow this epoch's bytes: root's own backstops,
        from root's own measurement (the coordinator's phase timeouts, from every rank's, abort earlier). The
        job's other trees on this node are taken to be as large: they dump to the same disk at once."""
        fp = self.runner.footprint
        if fp is None:
            return
        trees = 1 + len({name for name in ipc.job_trees(self.cgroup.other_trees(), self.ident.job).values()})
        estimate = budget.Estimate.of([budget.RankSize(str(i), "this node", fp.host_bytes, fp.gpu_bytes,
                                                       len(fp.gpu.held)) for i in range(trees)])
        capture_s = max(self.config.capture_timeout_s, budget.SAFETY * (estimate.dump + estimate.seal))
        self.criu.timeout_s = capture_s
        watchdog.set_limit(self.watchdog_fd, capture_s + 120)

    def _epoch_began(self, m: dict[str, Any]) -> None:
        """The first phase of an epoch (SIZE for GPU jobs, else PREPARE): recorded, and refused here, before
        anything is frozen, if the site policy forbids it."""
        final = validate.flag(m["final"], "final") if "final" in m else None
        self._failures().epoch_began(_epoch(m), final, validate.label(m.get("trigger", "unknown"), "trigger"))
        self._require_policy(_epoch(m), bool(final))

    def op_prepare(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self._epoch_began(m)
        # `final` is fixed here, where the policy judged it: CAPTURE takes this one, never its own (a
        # "final" PREPARE, exempt from min_interval, followed by a periodic CAPTURE was a periodic capture
        # as often as the job liked)
        self.prepared = (_epoch(m), m.get("final") is True, time.monotonic())
        if self.events:
            self.events.preparing(_epoch(m))
        with self._failures().recorded(_epoch(m), "prepare", self.runner):
            return self.runner.prepare(_epoch(m))

    def op_capture(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        epoch, said = _epoch(m), validate.flag(m.get("final", True), "final")
        if self.prepared is None or self.prepared[0] != epoch:
            raise ProtocolError(f"CAPTURE of epoch {epoch} without its PREPARE", epoch=epoch)
        _, final, prepared_at = self.prepared
        if "final" in m and said != final:
            raise ProtocolError(f"CAPTURE says final={said}, its PREPARE said final={final}", epoch=epoch)
        if not final:       # counted from its PREPARE, resumed or not (an aborted capture was one too)
            self.last_periodic = prepared_at
        self._failures().epoch_is_final(_epoch(m), final)
        with self._failures().recorded(_epoch(m), "capture", self.runner):
            reply = self.runner.capture(_epoch(m), final=final)
        if self.events:
            self.events.captured(_epoch(m), self._failures().epoch[2], final, int(reply.get("bytes", 0)))
        return reply

    def op_resume(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.events:
            self.events.resumed(_epoch(m))
        with self._failures().recorded(_epoch(m), "resume", self.runner):
            reply = self.runner.resume(_epoch(m))
        if self.events:
            self.events.persisted(_epoch(m))
        return reply

    def op_abort(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.events:
            self.events.aborted(_epoch(m))
        self.runner.abort(_epoch(m))
        return {}

    def op_finish(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self.runner.finish(_epoch(m))
        return {}

    def op_restore(self, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        durable.await_store(self.store.root, self.store_wait_s)   # a shared file system's server restarting
        why_not = self._not_restorable()
        if why_not is not None or not any(e["epoch"] == _epoch(m) for e in self.store.committed()):
            raise StorageError(why_not or f"epoch {_epoch(m)} is not a committed checkpoint of this job")
        if self.runner.root_pid:
            raise PermissionDenied("a tree is already running for this task")
        standins = m.get("standins", 0)
        if not (type(standins) is int and 0 <= standins <= len(fds) - 3 and len(fds) - standins in (3, 4)):
            raise ProtocolError("restore needs the 3 stdio fds (and the batch script's, for a batch step), then "
                                "one socket per srun stand-in")
        fds, handed = fds[:len(fds) - standins], tuple(fds[len(fds) - standins:])
        creds = self._task_credentials()
        init_home(self.config.run_dir, self._task_name, creds)
        self._place_with_slurm()
        self.gpu.visible_devices, self.gpu.device_order = self._allocated_gpus()
        start = time.monotonic()
        try:
            pid, manifest = self.runner.restore(self._context(creds, None, handed), _epoch(m), fds)
        except Exception as e:
            self._failures().restore_failed(_epoch(m), e)     # the reason if the task starts afresh
            if self.events:
                self.events.restore_failed(_epoch(m), reason_of(e))
            raise
        self.restored = _epoch(m)
        log.info("restored epoch %d as pid %s in %.3fs", _epoch(m), pid, time.monotonic() - start)
        if self.events:
            self.events.restored(_epoch(m), time.monotonic() - start)
        return {"pid": pid, "kind": manifest.capture.tree.kind, "seconds": time.monotonic() - start}


def _no_note(job: int, text: str) -> str:
    log.warning("no outlet for the job's comment (agent built without events): %s", text)
    return "none"
