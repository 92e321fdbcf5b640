"""A task's place in its job's epochs (used by the wrapper): find the job's coordinator, or host it (the batch
step, or rank 0 of a stand-alone step); serve its commands; survive its death (a half-done epoch is undone
here, then the task reconnects to the new coordinator); carry the task's events to it."""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from slurmckpt.task.defaults import uses_gpus
from slurmckpt.config import Config
from slurmckpt.coordinator.client import RankClient
from slurmckpt.coordinator.protocol import new_token
from slurmckpt.coordinator.supervisor import CoordinatorSupervisor, HostCallbacks
from slurmckpt.errors import SlurmckptError, SlurmError
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.slurm.env import TaskEnv

AgentCall = Callable[..., dict[str, Any]]
Handler = Callable[[str, int, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class HostEvents:
    """The wrapper's part of hosting the job's coordinator (the rest are agent calls: HostCallbacks)."""
    started: Callable[[str, str], None]               # a rank (re)started: open the replay gate
    result: Callable[[dict[str, Any], str, bool], None]         # an epoch ended (committed, aborted or skipped)
    interval: Callable[[dict[str, Any], str, bool], None]       # --checkpoint-interval=auto chose (coordinator/interval.py)


class Membership:
    reconnect_poll_s = 1.0          # how often a rank that lost its coordinator asks for the new one's address

    def __init__(self, env: TaskEnv, config: Config, call: AgentCall, handler: Handler,
                 say: Callable[[str], None]) -> None:
        self.env, self.config, self.call, self.handler, self.say = env, config, call, handler, say
        self.client: RankClient | None = None
        self.supervisor: CoordinatorSupervisor | None = None     # the hosting task only
        self.scope = "job"
        self.open_epoch: int | None = None      # prepared here and neither resumed nor aborted yet
        self.last_epoch = 0
        self.closing = False

    # ---- joining --------------------------------------------------------------------------------------
    def join(self, plan: dict[str, Any], host: HostEvents | None) -> None:
        """`host`: what the wrapper does for a coordinator it hosts (the agent calls are added here). The
        batch step always hosts; a step without a job coordinator is hosted by its rank 0."""
        host_scope = "job" if self.env.step == "batch" else None
        found = self.call("lookup_coordinator", scope="job", wait_s=0 if host_scope else 3)
        if not found["found"] and self.env.step != "batch":
            self.scope = self.env.step
            if self.env.rank == 0:
                host_scope = self.env.step
            else:
                found = self.call("lookup_coordinator", scope=self.env.step, wait_s=60)
        if host_scope and host:
            try:
                self._host(plan, host_scope, host)
            except OSError as e:
                self.say(f"cannot start the job's coordinator ({e}): this task runs without checkpoints")
                return
            found = self.call("lookup_coordinator", scope=host_scope, wait_s=0)
        if not found.get("found"):
            self.say("no coordinator found: this task runs without checkpoints")
            return
        self.client = self._connect(found)
        if self.client is not None:
            threading.Thread(target=self._session, name="coordinator-client", daemon=True).start()

    def _host(self, plan: dict[str, Any], scope: str, host: HostEvents) -> None:
        token = new_token()
        single_node = os.environ.get("SLURM_JOB_NUM_NODES", "1") == "1"
        address = "127.0.0.1" if single_node else reachable_address(self.env.node)
        settings = {"token": token, "bind": address, "next_epoch": plan["next_epoch"],
                    "completed": dict(plan.get("completed", {})),
                    "prepare_timeout_s": self.config.prepare_timeout_s,
                    "capture_timeout_s": self.config.capture_timeout_s, "lock_rounds": self.config.gpu_lock_rounds,
                    "persist_timeout_s": self.config.persist_timeout_s,
                    **({"auto": plan["auto"]} if isinstance(plan.get("auto"), dict) else {})}
        callbacks = HostCallbacks(
            started=host.started, result=host.result, interval=host.interval, say=self.say,
            commit=lambda epoch, ranks, reason, final: self.call("commit", epoch=epoch, ranks=ranks, reason=reason,
                                                                 final=final),
            allocate=lambda at_least, final: int(self.call("allocate_epoch", at_least=at_least, final=final)["epoch"]),
            publish=lambda port: self.call("publish_coordinator", scope=scope, host=address, port=port, token=token),
            interruptions=lambda: {k: v for k, v in self.call("interruptions").items() if k != "ok"})
        self.supervisor = CoordinatorSupervisor(self.env.job_id, settings, callbacks)
        self.supervisor.start()

    def _connect(self, found: dict[str, Any], quiet: bool = False) -> RankClient | None:
        try:
            return RankClient(found["host"], found["port"], found["token"], self.env.rank_name, self.env.node,
                              self.env.interval_s, self._command, self.env.tasks, self.last_epoch,
                              gpus=uses_gpus(dict(os.environ)))
        except (OSError, SlurmckptError, EOFError) as e:
            if not quiet:
                self.say(f"cannot reach the job's coordinator ({e}): this task runs without checkpoints until "
                         "it can")
            return None

    # ---- serving ---------------------------------------------------------------------------------------
    def _command(self, kind: str, epoch: int, message: dict[str, Any]) -> dict[str, Any]:
        self.last_epoch = max(self.last_epoch, epoch)
        if self.supervisor:
            self.supervisor.saw_epoch(epoch)
        if kind == "prepare":
            self.open_epoch = epoch
        elif kind in ("resume", "abort", "finish"):
            self.open_epoch = None
        return self.handler(kind, epoch, message)

    def _session(self) -> None:
        """Serve the coordinator's commands. A lost connection (the coordinator died or is being restarted)
        leaves no epoch half done here: the tree is thawed, then the task reconnects to the new one."""
        while self.client is not None:
            self.client.serve_forever()
            self._abandon_epoch()
            if self.closing:
                return
            self.client = None
            self.say("lost the job's coordinator; the task runs on and reconnects")
            while self.client is None and not self.closing:
                time.sleep(self.reconnect_poll_s)
                found = self.call("lookup_coordinator", scope=self.scope, wait_s=0)
                if found.get("found"):
                    self.client = self._connect(found, quiet=True)
            if self.client is not None:
                self.say(f"reconnected to the job's coordinator at {found['host']}:{found['port']}")

    def _abandon_epoch(self) -> None:
        epoch, self.open_epoch = self.open_epoch, None
        if epoch is None:
            return
        try:
            self.handler("abort", epoch, {})
            self.say(f"epoch {epoch} abandoned (its coordinator was lost mid-epoch): the task runs on, the "
                     "previous checkpoint stays the one restored")
        except (OSError, SlurmckptError, EOFError) as e:
            self.say(f"epoch {epoch} abandoned, but undoing it failed: {e}")

    # ---- events ----------------------------------------------------------------------------------------
    def trigger(self, reason: str, final: bool) -> None:
        """Ask for an epoch: the host tells its coordinator process; other ranks tell it over their link."""
        if self.supervisor:
            self.supervisor.trigger(reason, final)
        else:
            self.event("trigger", reason=reason, final=final)

    def event(self, kind: str, wait_ack: bool = False, **fields: Any) -> None:
        if self.client:
            try:
                self.client.event(kind, wait_ack=wait_ack, **fields)
            except OSError as e:
                self.say(f"cannot reach the job's coordinator ({kind}): {e}")

    @property
    def connected(self) -> bool:
        return self.client is not None

    def reaped(self, pid: int, code: int) -> None:
        if self.supervisor:
            self.supervisor.reaped(pid, code)

    def close(self, exit_code: int, completed: bool = True) -> None:
        """The task ended. Ended by itself (`completed`), the coordinator records its exit code (a later
        capture restores it as completed); ended by a SIGTERM the wrapper passed on, or killed by its agent
        (its GPU state was lost), it only leaves the job."""
        if completed:
            self.event("exited", exit_code=exit_code)
        self.stop()

    def stop(self) -> None:
        self.closing = True
        if self.supervisor:
            self.supervisor.stop()


def reachable_address(node: str) -> str:
    """The address other nodes reach this one at: Slurm's NodeAddr for it, else the default route's
    source address (a UDP connect sends nothing), else loopback."""
    try:
        addr = CliSlurm(timeout_s=10).node_addr(node)
        if addr:
            return socket.gethostbyname(addr)
    except (SlurmError, OSError):
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
