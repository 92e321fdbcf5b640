"""How a root agent starts (docs/architecture.md, "Privilege model"): who it serves comes from the SPANK
shim's argv and from slurmctld by the trusted job id, never from the job's environment; then its config,
its logs, the site policy for its job's partition and QOS (policy.py), and its outlets (events.py)."""
from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from slurmckpt.agent import logs as agentlog
from slurmckpt.store import durable
from slurmckpt.agent.service import Agent
from slurmckpt.identity import TaskIdentity
from slurmckpt.channel import Channel
from slurmckpt.config import Config, load_root_config
from slurmckpt.duration import interval_arg
from slurmckpt.errors import SlurmckptError, StorageError
from slurmckpt.agent.events import AgentEvents, SlurmdLog, Task
from slurmckpt.agent.metrics import NodeMetrics, node_name
from slurmckpt.node.peer import Peer
from slurmckpt.policy import JobPolicy
from slurmckpt.store.job_comment import JobComment
from slurmckpt.slurm.control import CliSlurm, job_record
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.slurm.window import KillWindow
from slurmckpt.agent.window import FinalWindow
from slurmckpt.slurm.namespaces import job_namespace_refusal
from slurmckpt.store.jobstore import JobStore

log = logging.getLogger("slurmckpt.agent")


@dataclass(frozen=True)
class ShimArgs:
    """What the SPANK shim passed (spank/agent_spawn.c), as trusted as Slurm itself."""
    fd: int
    job: int
    step: str
    rank: int
    uid: int
    gid: int
    restart_count: int = 0
    init: str | None = None
    interval: str | None = None        # seconds or auto (duration.interval_arg); None: a shim that does not say
    interval_from: str = "option"      # option (the job's --checkpoint-interval) | default (default_interval=)
    log_fd: int | None = None          # the log relay into slurmd's log (spank/log_relay.c)


def slurm_config() -> dict[str, str]:
    """`scontrol show config`, once per agent: the cluster's name and the kill window's settings."""
    try:
        return CliSlurm(timeout_s=20).config_values()
    except SlurmckptError as e:
        log.warning("scontrol show config: %s", e)
        return {}


def kill_window(values: dict[str, str], slurm_job: JobRecord | None) -> KillWindow:
    """The time Slurm gives this job from SIGTERM to SIGKILL (slurm/window.py), read once at the start."""
    if not values:
        return KillWindow(known=False)
    try:
        return CliSlurm(timeout_s=20).kill_window(slurm_job.partition if slurm_job else "",
                                                  slurm_job.qos if slurm_job else "", values)
    except SlurmckptError as e:
        log.warning("the kill window of partition/QOS: %s; KillWait alone counts", e)
        return KillWindow(KillWindow().kill_wait_s, known=False)


def _slurm_job(job: int, uid: int, gid: int, attempts: int = 2) -> JobRecord | None:
    """The job as slurmctld knows it; None (nothing restored, commits stay unbound) if it cannot say, or
    if it names another owner than the shim's argv."""
    for attempt in range(attempts):
        try:
            record = job_record(job)
        except SlurmckptError as e:
            log.warning("squeue --json for job %d (attempt %d): %s", job, attempt + 1, e)
            time.sleep(0.5)
            continue
        if (record.uid, record.gid) != (uid, gid):
            log.error("Slurm says job %d belongs to uid %d gid %d, the shim said %d/%d: not bound", job,
                      record.uid, record.gid, uid, gid)
            return None
        return record
    return None


def job_policy(config: Config, slurm_job: JobRecord | None) -> JobPolicy:
    """The site policy for the partition and QOS slurmctld says the job runs in (the default rule alone
    when slurmctld could not be asked)."""
    if slurm_job is None:
        return config.policy.for_job([], None)
    return config.policy.for_job([slurm_job.partition] if slurm_job.partition else [], slurm_job.qos or None)


def run_agent(args: ShimArgs) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)    # Slurm signals every process of the step; we act on the wrapper's word
    if args.step != "batch" and not args.step.isdigit():
        raise SystemExit(f"slurmckpt agent: bad step {args.step!r}")
    config = load_root_config()
    if args.init:
        config = dataclasses.replace(config, init_path=args.init)
    agentlog.setup(config, args.job, args.step, args.rank)
    # slurmstepd never fills S_SLURM_RESTART_COUNT (22.05 to 26.05: the shim's count is 0): slurmctld's
    # restart_cnt, by the trusted job id. Without it nothing is restored (the instance is unknown).
    slurm_job = _slurm_job(args.job, args.uid, args.gid)
    restart_count = max(args.restart_count, slurm_job.restarts) if slurm_job else args.restart_count
    values = slurm_config()
    ident = TaskIdentity(values.get("ClusterName") or "cluster", args.job, args.step, args.rank, args.uid, args.gid,
                         restart_count)
    policy = job_policy(config, slurm_job)
    peer = Peer.parent()
    # Slurm's per-job user/PID namespaces (namespace/linux): refused here, by name, before anything is frozen
    in_own_ns = job_namespace_refusal(peer.pid)
    if in_own_ns:
        policy = policy.refused_by("NamespaceType=namespace/linux", in_own_ns)
    config = config.with_settings(dict(policy.settings))     # keep_epochs, compression for this job
    # A shared file system whose server restarts answers ENOTCONN/EIO for a while: wait for it rather than
    # start the task from the beginning (docs/storage.md, "Shared file systems").
    outage = None
    try:
        waited = durable.await_store(Path(config.storage_root), config.store_wait_s)
        if waited >= 1:
            outage = f"the image store did not answer for {waited:.0f}s at the start (its server was down); waited"
    except StorageError as e:
        outage = str(e)
    if outage:
        log.warning("%s", outage)
    store = JobStore(Path(config.storage_root), ident.cluster, ident.job)
    node = node_name()
    task = ident.tree.task
    events = AgentEvents(Task(ident.job, ident.step, ident.rank, ident.uid, node), store, config,
                         SlurmdLog(args.log_fd), JobComment(store, ident.job, config.job_comment_field),
                         NodeMetrics(config.metrics_textfile, config.run_dir, task, node))
    interval = interval_arg(args.interval) if args.interval is not None else 0
    window = kill_window(values, slurm_job)
    agent = Agent.start(ident, Channel.from_fd(args.fd), config, peer, slurm_job, events=events, policy=policy,
                        interval=(interval, args.interval is None or args.interval_from == "option"),
                        store_outage=outage,
                        final_window=FinalWindow(window, ident.job, CliSlurm(timeout_s=5).preempted))
    log.info("Slurm's window for a final capture: %s; %s when preempted", window.describe(False),
             window.describe(True))
    log.info("job instance from Slurm: %s; restart count %d; policy %s", slurm_job, restart_count,
             policy.describe())
    log.info("agent up for wrapper pid %d on %s; network lock: %s", agent.tree.wrapper_pid, socket.gethostname(),
             agent.tree.packets.name)
    agent.serve()
