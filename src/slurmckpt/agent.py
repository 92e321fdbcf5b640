"""The per-task privileged agent (root). Started by the SPANK shim in slurm_spank_task_init_privileged as a
child of the task, so job, step, rank and uid come from Slurm, not from the user.

It serves exactly one peer, the task's wrapper, over an inherited socket, and acts only on the tree it
started or restored itself and on this job's images: no request names a pid, a path or another job.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from slurmckpt.channel import Channel
from slurmckpt.config import Config
from slurmckpt.criu import CriuDriver
from slurmckpt.errors import PermissionDenied, ProtocolError, SlurmckptError, StorageError
from slurmckpt.freezer import Freezer
from slurmckpt.fresh_start import FailureReporter, coordinator_verdict
from slurmckpt.instance import JobInstance, claim, mismatch, moved_aside_notes
from slurmckpt.cuda.stage import PipelineGpu
from slurmckpt import pmi, watchdog
from slurmckpt.launch import Credentials, init_home, spawn_tree
from slurmckpt.peer import Peer
from slurmckpt.pipeline import RankPipeline, restore_rank
from slurmckpt.rank_images import StorePolicy
from slurmckpt import reclaim
from slurmckpt.slurm.control import CliSlurm, JobRecord, job_record, this_node
from slurmckpt.storage import JobStore, atomic_write_json, rank_name
from slurmckpt import validate

log = logging.getLogger("slurmckpt.agent")


@dataclass(frozen=True)
class TaskIdentity:
    """Trusted: from the SPANK shim's argv."""
    cluster: str
    job: int
    step: str
    rank: int
    uid: int
    gid: int
    restart_count: int


class Agent:
    restored: int | None = None          # the epoch this task restored (None: not restored)

    def __init__(self, ident: TaskIdentity, channel: Channel, config: Config, peer: Peer,
                 slurm_job: JobRecord | None = None) -> None:
        self.ident, self.channel, self.config, self.peer = ident, channel, config, peer
        self.wrapper_pid = peer.pid
        self.store = JobStore(Path(config.storage_root), ident.cluster, ident.job)
        self.store.ensure()
        self.policy = StorePolicy.from_config(config)
        # The job instance, from slurmctld by the trusted job id (instance.py); None: Slurm did not answer
        self.slurm_job = slurm_job
        self.instance = None if slurm_job is None else JobInstance(
            ident.cluster, ident.job, ident.uid, ident.gid, slurm_job.submit_time, ident.restart_count)
        self.store_note = claim(self.store, self.instance) if self.instance else None
        if self.store_note:
            log.warning("%s", self.store_note)
        name = f"{ident.job}.{ident.step}.{ident.rank}.{ident.restart_count}"
        self.freezer = Freezer.for_task(config.freezer_root, name)
        # Root alone writes the freeze control; the watchdog thaws the tree if this agent dies with it frozen.
        self.watchdog_fd = watchdog.start(self.freezer, config.capture_timeout_s + 120)
        self.pipeline = RankPipeline(self.store, ident.step, ident.rank, self.freezer,
                                     CriuDriver(config.criu_path, config.criu_extra_args, config.capture_timeout_s),
                                     PipelineGpu(config.gpu_lock_timeout_ms,
                                                 context={"job": ident.job, "step": ident.step, "rank": ident.rank}),
                                     None, peer.pid, stall_after=config.stall(),  # type: ignore[arg-type]
                                     peer_alive=peer.alive, ghost_limit_max=config.ghost_limit_max,
                                     policy=self.policy)
        self._collect_garbage()
        self.reporter = FailureReporter(self.store, ident.job, rank_name(ident.step, ident.rank),
                                        socket.gethostname())

    def _collect_garbage(self) -> None:
        """This job's dead epochs and this node's orphaned staging areas (reclaim.py): never fatal."""
        try:
            for r in reclaim.collect_job(self.store) + reclaim.collect_staging(self.policy.staging):
                log.info("reclaimed %s (%d bytes): %s", r.path, r.bytes, r.why)
        except (OSError, SlurmckptError) as e:
            log.warning("garbage collection at start failed: %s", e)

    def _task_credentials(self) -> Credentials:
        """Read when needed: at agent start the task has not yet dropped to the job's user."""
        creds = Credentials.of_process(self.peer.require(), self.ident.uid)
        self.peer.require()            # what was read is the wrapper's, not a process that reused its pid
        self.pipeline.creds = creds
        return creds

    @property
    def _task_name(self) -> str:
        return f"{self.ident.job}.{self.ident.step}.{self.ident.rank}"

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
                self._reply_error(e)
            except Exception as e:  # the agent boundary: report, never die with the tree frozen
                log.exception("%s crashed", message.get("op"))
                self._reply_error(SlurmckptError(f"{type(e).__name__}: {e}"))
            finally:
                for fd in fds:
                    os.close(fd)
        self.shutdown()

    def _reply_error(self, e: SlurmckptError) -> None:
        try:
            self.channel.send({"ok": False, "error": str(e), "error_type": type(e).__name__})
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wrapper gone. Whatever of the tree is left would escape Slurm's tracking (its subreaper died):
        end it, and never leave anything frozen."""
        try:
            self.freezer.kill_all()
        except OSError:
            pass
        self.freezer.remove()

    # ---- operations ------------------------------------------------------------------------------------
    def op_hello(self, m: dict, fds: list[int]) -> dict:
        i = self.ident
        return {"job": i.job, "step": i.step, "rank": i.rank, "cluster": i.cluster,
                "restart_count": i.restart_count, "node": socket.gethostname()}

    def op_plan(self, m: dict, fds: list[int]) -> dict:
        """What this task should do: the committed epochs that hold it, newest first."""
        me = rank_name(self.ident.step, self.ident.rank)
        try:
            why_not = self._not_restorable()
            epochs = [] if why_not is not None else self.store.committed()
        except StorageError as e:
            why_not, epochs = str(e), []
        if why_not is not None:
            return {"candidates": [], "next_epoch": self.store.next_epoch(), "completed": {},
                    **({"warning": why_not} if why_not else {}),
                    "tree_procs": str(self.freezer.path / "cgroup.procs")}
        candidates = [{"epoch": e["epoch"], **e["ranks"][me]} for e in epochs if me in e["ranks"]]
        completed = {n: r for n, r in (epochs[0]["ranks"].items() if epochs else []) if r["kind"] == "completed"}
        notes = moved_aside_notes(self.store)[-1:]      # a foreign store moved aside at a commit (instance.py)
        if candidates and self.ident.step == "batch":   # a newer capture failed: its work since is lost
            notes += filter(None, [self.reporter.failed_since(candidates[0]["epoch"])])
        return {"candidates": candidates, "next_epoch": self.store.next_epoch(), "completed": completed,
                "newest": epochs[0]["epoch"] if epochs else None, "tree_procs": str(self.freezer.path / "cgroup.procs"),
                **({"warning": "; ".join(notes)} if notes else {})}

    def _not_restorable(self) -> str | None:
        """None when this task may restore the store's images; else why not ("" for a first run with
        nothing to say). Images are bound to the job instance that wrote them (instance.py)."""
        if self.instance is None:
            return (f"checkpoints of job {self.ident.job} are not restored: slurmckpt could not learn the "
                    "job's instance (uid, gid, submit time) from Slurm")
        if self.ident.restart_count == 0:       # a job that was never requeued has nothing to restore
            return "; ".join([self.store_note] if self.store_note else moved_aside_notes(self.store)[-1:])
        why = mismatch(self.store.read_manifest().get("instance"), self.instance)
        if why:
            return f"checkpoints of job {self.ident.job} are not restored: {why}"
        return None

    def op_launch(self, m: dict, fds: list[int]) -> dict:
        if self.pipeline.root_pid:
            raise PermissionDenied("a tree was already started for this task")
        argv, env, cwd = m.get("argv"), m.get("env"), m.get("cwd")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
                and isinstance(env, dict) and isinstance(cwd, str) and len(fds) == 3):
            raise ProtocolError("launch needs argv (list of str), env (dict), cwd and 3 stdio fds")
        env = {str(k): str(v) for k, v in env.items()}
        if any("\0" in a for a in [*argv, *env, *env.values(), cwd]) or any("=" in k or not k for k in env):
            raise ProtocolError("launch: NUL in argv/env/cwd, or an env name that is empty or holds '='")
        # CUDA refuses to work in a PID namespace that sees the host's /proc, and a private /proc would need
        # CRIU to restore a mount namespace: GPU tasks run in the host's (docs/limitations.md).
        if self.ident.step == "batch" and self.ident.restart_count and self.restored is None:
            self._fresh_start_notice()      # said (AdminComment) even if the wrapper did not ask
        own_pidns = not uses_gpus(env)
        creds = self._task_credentials()
        self._place_with_slurm()
        pid = spawn_tree(argv, env, cwd, fds, creds, self.config.init_path, self.freezer,
                         init_home(self.config.run_dir, self._task_name, creds), own_pidns)
        self.pipeline.root_pid = pid
        log.info("launched %s as pid %d", argv[0], pid)
        return {"pid": pid}

    def _place_with_slurm(self) -> None:
        """The tree goes where Slurm put the task (its step/task cgroups, read from the wrapper now that
        slurmstepd has placed it), and into our freeze cgroup: Slurm keeps tracking, limiting and
        accounting it (freezer.py)."""
        self.freezer = self.freezer.in_slurm_cgroups_of(self.peer.require(), self.ident.job)
        self.peer.require()
        self.pipeline.freezer = self.freezer
        log.info("tree cgroups: %s + %s", ", ".join(str(p.parent) for p in self.freezer.slurm_procs) or "-",
                 self.freezer.path)

    def op_pmi_socket(self, m: dict, fds: list[int]) -> dict:
        """The task's PMI socket to slurmstepd (`srun --mpi=pmi2`, pmi.py): dumped as external, replaced at
        the restore by this start's. Only the fd's own type is trusted; it goes into the user's tree only."""
        if len(fds) != 1:
            raise ProtocolError("pmi_socket needs the task's PMI fd")
        ino = pmi.require_unix_stream(fds[0])
        if self.pipeline.pmi_fd >= 0:
            os.close(self.pipeline.pmi_fd)
        self.pipeline.pmi_fd, self.pipeline.pmi_ino = os.dup(fds[0]), ino
        return {"ino": ino}

    def op_fresh_start(self, m: dict, fds: list[int]) -> dict:
        """The batch step of a requeued job that restored nothing: the line its wrapper prints first, also
        set as the job's AdminComment (fresh_start.py). None for a first run or a restored one."""
        if self.ident.step != "batch" or not self.ident.restart_count or self.restored is not None:
            return {"notice": None}
        return {"notice": self._fresh_start_notice()}

    def _fresh_start_notice(self) -> str:
        try:
            why_not = self._not_restorable()
        except StorageError as e:
            why_not = str(e)
        return self.reporter.fresh_start(self.ident.restart_count, why_not or self.store_note)

    def op_capture_failed(self, m: dict, fds: list[int]) -> dict:
        """The job's coordinator aborted an epoch (its verdict, relayed by the wrapper hosting it): recorded
        unless a rank's agent recorded that epoch itself. It only informs: nothing acts on it."""
        self.reporter.capture_failed(**coordinator_verdict(m))
        return {}

    def op_prepare(self, m: dict, fds: list[int]) -> dict:
        self.reporter.epoch_began(_epoch(m), validate.flag(m["final"], "final") if "final" in m else None,
                                  validate.label(m.get("trigger", "unknown"), "trigger"))
        with self.reporter.recorded(_epoch(m), "prepare", self.pipeline):
            return self.pipeline.prepare(_epoch(m))

    def op_capture(self, m: dict, fds: list[int]) -> dict:
        final = validate.flag(m.get("final", True), "final")
        self.reporter.epoch_is_final(_epoch(m), final)
        with self.reporter.recorded(_epoch(m), "capture", self.pipeline):
            return self.pipeline.capture(_epoch(m), final=final)

    def op_resume(self, m: dict, fds: list[int]) -> dict:
        with self.reporter.recorded(_epoch(m), "resume", self.pipeline):
            return self.pipeline.resume(_epoch(m))

    def op_abort(self, m: dict, fds: list[int]) -> dict:
        self.pipeline.abort(_epoch(m))
        return {}

    def op_finish(self, m: dict, fds: list[int]) -> dict:
        self.pipeline.finish(_epoch(m))
        return {}

    def op_commit(self, m: dict, fds: list[int]) -> dict:
        ranks = validate.commit_ranks(m.get("ranks"))
        reason = validate.label(m.get("reason", "unknown"), "reason")
        # A foreign store copied in meanwhile is moved aside; without a known instance the commit stays
        # unbound, which no restore accepts (and the next bound agent moves aside).
        note = claim(self.store, self.instance, keep_epoch=_epoch(m)) if getattr(self, "instance", None) else None
        if note:
            log.warning("%s", note)
        self.store.commit(_epoch(m), ranks, reason, self.config.keep_epochs)
        threading.Thread(target=self.store.empty_trash, daemon=True).start()
        log.info("committed epoch %d (%s) with %d ranks", _epoch(m), reason, len(ranks))
        return {}

    def op_allocate_epoch(self, m: dict, fds: list[int]) -> dict:
        """A new epoch number for the coordinator this task's wrapper hosts: unique across the job's steps
        and coordinators (storage.allocate_epoch). Its lease covers every phase the epoch may still take."""
        c = self.config
        lease = c.prepare_timeout_s + c.capture_timeout_s + c.persist_timeout_s + 120
        at_least = validate.integer(m.get("at_least", 1), "at_least", 1, validate.MAX_EPOCH)
        epoch = self.store.allocate_epoch(at_least, lease, f"{socket.gethostname()}:{self._task_name}")
        return {"epoch": validate.epoch(epoch)}

    def op_restore(self, m: dict, fds: list[int]) -> dict:
        why_not = self._not_restorable()
        if why_not is not None or not any(e["epoch"] == _epoch(m) for e in self.store.committed()):
            raise StorageError(why_not or f"epoch {_epoch(m)} is not a committed checkpoint of this job")
        if self.pipeline.root_pid:
            raise PermissionDenied("a tree is already running for this task")
        if len(fds) not in (3, 4):
            raise ProtocolError("restore needs the 3 stdio fds (and the batch script's, for a batch step)")
        init_home(self.config.run_dir, self._task_name, self._task_credentials())
        self._place_with_slurm()
        self.pipeline.gpu.visible_devices, self.pipeline.gpu.device_order = self._allocated_gpus()
        start = time.monotonic()
        try:
            pid, manifest = restore_rank(self.pipeline, _epoch(m), fds)
        except Exception as e:
            self.reporter.restore_failed(_epoch(m), e)     # the reason if the task starts afresh
            raise
        self.restored = _epoch(m)
        log.info("restored epoch %d as pid %s in %.3fs", _epoch(m), pid, time.monotonic() - start)
        return {"pid": pid, "kind": manifest["kind"], "seconds": time.monotonic() - start}

    def _allocated_gpus(self) -> tuple[str, str]:
        """The GPUs this task restores onto: Slurm's allocation of the job on this node (indices in gres.conf
        File= order, i.e. /dev/nvidiaN order = PCI bus order), never the wrapper's environment. A step that
        narrows them with CUDA_VISIBLE_DEVICES to allocated indices keeps its narrowing; any other value is
        ignored (a user naming a GPU of another job changes nothing)."""
        gpus = self.slurm_job.gpus if self.slurm_job else {}
        node = this_node(sorted(gpus), socket.gethostname()) or socket.gethostname()
        allocated = gpus.get(node, [])
        claimed = _environ_of(self.wrapper_pid).get("CUDA_VISIBLE_DEVICES", "")
        items = [s.strip() for s in claimed.split(",") if s.strip()]
        narrowed = bool(items) and all(s.isdigit() and int(s) in allocated for s in items) \
            and len(set(items)) == len(items)
        chosen = [int(s) for s in items] if narrowed else allocated
        log.info("GPUs for restore from Slurm's allocation on %s: %s; used: %s (wrapper's CUDA_VISIBLE_DEVICES "
                 "%r %s)", node, allocated, chosen, claimed[:64], "narrows it" if narrowed else "not used")
        return ",".join(str(i) for i in chosen), "PCI_BUS_ID"

    def op_reject_epoch(self, m: dict, fds: list[int]) -> dict:
        """This rank could not restore the epoch: no rank of the job may restore it (one consistent cut)."""
        epoch, why = _epoch(m), validate.text(m.get("reason", ""), "reason")
        rejected = self.store.reject(epoch, f"rank {self._task_name} could not restore it: {why}"[:500])
        log.warning("epoch %d rejected for the whole job (%r)", epoch, why[:500])
        return {"rejected": rejected}

    def op_publish_coordinator(self, m: dict, fds: list[int]) -> dict:
        address = {"host": validate.ip_address(m.get("host")), "port": validate.port(m.get("port")),
                   "token": validate.token(m.get("token")),
                   "restart_count": self.ident.restart_count, "published_by": rank_name(self.ident.step,
                                                                                         self.ident.rank)}
        atomic_write_json(self._coordinator_file(m.get("scope", "job")), address)
        return {}

    def op_lookup_coordinator(self, m: dict, fds: list[int]) -> dict:
        """The job's coordinator address, from a root-owned file only this job's agents read."""
        deadline = time.monotonic() + validate.wait_s(m.get("wait_s", 0))
        path = self._coordinator_file(m.get("scope", "job"))
        while True:
            try:
                address = json.loads(path.read_text())
                if address["restart_count"] == self.ident.restart_count:
                    return {"found": True, **address}
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() >= deadline:
                return {"found": False}
            time.sleep(0.2)

    def _coordinator_file(self, scope: object) -> Path:
        scope = validate.scope(scope)
        return self.store.job_dir / f"coordinator-{scope}.json"


def uses_gpus(env: dict[str, str]) -> bool:
    value = env.get("CUDA_VISIBLE_DEVICES", "")
    return bool(value) and value not in ("NoDevFiles", "-1")


def _environ_of(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _epoch(m: dict) -> int:
    return validate.epoch(m.get("epoch"))


def cluster_name() -> str:
    try:
        return CliSlurm(timeout_s=20).cluster_name() or "cluster"
    except SlurmckptError:
        return "cluster"


def _restart_count(job: int) -> int:
    try:
        return int(CliSlurm(timeout_s=20).job(job).get("restart_cnt", 0))
    except (SlurmckptError, ValueError, TypeError):
        return 0


def _slurm_job(job: int, uid: int, gid: int, attempts: int = 2) -> JobRecord | None:
    """The job as slurmctld knows it; None (nothing restored, commits stay unbound) if it cannot say, or
    if it names another owner than the shim's argv."""
    for attempt in range(attempts):
        try:
            record = job_record(job)
        except SlurmckptError as e:
            log.warning("scontrol show job %d (attempt %d): %s", job, attempt + 1, e)
            time.sleep(0.5)
            continue
        if (record.uid, record.gid) != (uid, gid):
            log.error("Slurm says job %d belongs to uid %d gid %d, the shim said %d/%d: not bound", job,
                      record.uid, record.gid, uid, gid)
            return None
        return record
    return None


def run_agent(fd: int, job: int, step: str, rank: int, uid: int, gid: int, restart_count: int,
              init: str | None) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)    # Slurm signals every process of the step; we act on the wrapper's word
    config = Config.load()
    if init:
        config = Config.from_mapping({**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                      "init_path": init})
    if step != "batch" and not step.isdigit():
        raise SystemExit(f"slurmckpt agent: bad step {step!r}")
    Path(config.log_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    logging.basicConfig(filename=f"{config.log_dir}/agent-{job}.{step}.{rank}.log", level=logging.INFO,
                        format=f"%(asctime)s %(name)s job={job} step={step} rank={rank} pid=%(process)d "
                               "%(levelname)s %(message)s")
    # Slurm 22.05's slurmstepd never fills S_SLURM_RESTART_COUNT (and its squeue --json says restart_cnt 0
    # after a requeue): ask slurmctld, by the trusted job id.
    slurm_job = _slurm_job(job, uid, gid)
    restart_count = max(restart_count, slurm_job.restarts) if slurm_job else (restart_count or _restart_count(job))
    ident = TaskIdentity(cluster_name(), job, step, rank, uid, gid, restart_count)
    agent = Agent(ident, Channel.from_fd(fd), config, Peer.parent(), slurm_job)
    log.info("job instance from Slurm: %s; restart count %d", slurm_job, restart_count)
    log.info("agent up for wrapper pid %d", agent.wrapper_pid)
    agent.serve()
