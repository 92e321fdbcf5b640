"""The task wrapper (runs as the job's user): slurmstepd execs it in place of the task's command.

It asks its root agent to start the command as a checkpointable tree (or to restore the newest committed
checkpoint), stays the tree's parent (PR_SET_CHILD_SUBREAPER), forwards signals, turns Slurm's SIGTERM into a
final capture, takes part in the job's epochs through the coordinator, and exits with the workload's code.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import sys
import threading
import time

from slurmckpt.channel import Channel
from slurmckpt.config import load_user_config
from slurmckpt.coordinator.client import RankClient
from slurmckpt.coordinator.protocol import new_token
from slurmckpt.coordinator.supervisor import CoordinatorSupervisor, HostCallbacks
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.env import PRIVATE, TaskEnv
from slurmckpt.triggers import Schedule

log = logging.getLogger("slurmckpt.wrapper")

PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
             signal.SIGWINCH, signal.SIGCONT)
CHECKPOINT_SIGNAL = signal.SIGRTMIN + 4     # `slurmckpt checkpoint JOBID` (scancel --batch --signal)
REQUEUE_SIGNAL = signal.SIGRTMIN + 5        # `slurmckpt checkpoint --requeue JOBID`


def say(env: TaskEnv, message: str) -> None:
    """One line in the job's stderr: users see what slurmckpt did to their job."""
    stamp = time.strftime("%H:%M:%S")
    os.write(2, f"slurmckpt[{stamp} job {env.job_id} {env.rank_name}]: {message}\n".encode())


class Wrapper:
    def __init__(self, env: TaskEnv, argv: list[str]) -> None:
        self.env, self.argv = env, argv
        self.config = load_user_config()
        assert env.agent_fd is not None
        os.set_inheritable(env.agent_fd, False)          # the workload never gets the agent's socket
        self.agent = Channel.from_fd(env.agent_fd)
        self.agent_lock = threading.Lock()
        self.root_pid: int | None = None
        self.final_committed = threading.Event()
        self.final_capture = threading.Event()          # criu ends the tree itself in a final capture
        self.gate = threading.Event()                    # replayed batch output passes once a step resumes
        self.gate.set()
        self.supervisor: CoordinatorSupervisor | None = None     # hosting wrapper only
        self.host_interval = 0
        self.client: RankClient | None = None
        self.scope = "job"
        self.open_epoch: int | None = None              # prepared here and neither resumed nor aborted yet
        self.last_epoch = 0
        self.exiting = False
        self.agent_gone = False
        self.awaiting_requeue = False        # a coordinated fallback asked Slurm to restart the job
        self.thaw_control: str | None = None
        self.schedule: Schedule | None = None
        self.pending: list[int] = []
        self.relays: list[threading.Thread] = []

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict:
        with self.agent_lock:
            try:
                return self.agent.call(op, fds, **args)
            except (EOFError, OSError) as e:
                self._agent_lost(op)
                raise SlurmckptError(f"the task's root agent is gone ({e})", op=op) from e

    def _agent_lost(self, op: str) -> None:
        """The root agent died (killed, crashed). Without it nothing can be captured or restored here; what
        must not happen is a tree left frozen: the wrapper may write its freeze control (Freezer.grant_thaw)."""
        if self.agent_gone:
            return
        self.agent_gone = True
        thawed = ""
        if self.thaw_control:
            try:
                with open(self.thaw_control, "w") as f:
                    f.write("THAWED" if self.thaw_control.endswith("freezer.state") else "0")
                thawed = "; its tree was thawed"
            except OSError as e:
                thawed = f"; thawing its tree failed: {e}"
        say(self.env, f"the task's root agent died (during {op}){thawed}: the task runs on, but can take no "
                      "part in checkpoints; the last committed checkpoint stays the one restored")

    # ---- start ---------------------------------------------------------------------------------------
    def run(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        for sig in (*FORWARDED, signal.SIGTERM, signal.SIGCHLD, CHECKPOINT_SIGNAL, REQUEUE_SIGNAL):
            signal.signal(sig, lambda s, f: self.pending.append(s))
        plan = self.call("plan")
        self.thaw_control = plan.get("thaw_control")
        self._join_coordinator(plan)
        self._start(plan)
        return self._supervise(wake_r)

    def _join_coordinator(self, plan: dict) -> None:
        host_scope = "job" if self.env.step == "batch" else None
        self.scope = "job"
        found = self.call("lookup_coordinator", scope="job", wait_s=0 if host_scope else 3)
        if not found["found"] and self.env.step != "batch":
            self.scope = self.env.step
            if self.env.rank == 0:
                host_scope = self.env.step
            else:
                found = self.call("lookup_coordinator", scope=self.env.step, wait_s=60)
        if host_scope:
            try:
                self._host_coordinator(plan, host_scope)
            except OSError as e:
                say(self.env, f"cannot start the job's coordinator ({e}): this task runs without checkpoints")
                return
            found = self.call("lookup_coordinator", scope=host_scope, wait_s=0)
        if not found.get("found"):
            say(self.env, "no coordinator found: this task runs without checkpoints")
            return
        self.client = self._connect(found)
        if self.client is None:
            return
        threading.Thread(target=self._rank_session, name="coordinator-client", daemon=True).start()

    def _connect(self, found: dict, quiet: bool = False) -> RankClient | None:
        try:
            return RankClient(found["host"], found["port"], found["token"], self.env.rank_name, self.env.node,
                              self.env.interval_s, self._on_command, self.env.tasks, self.last_epoch)
        except (OSError, SlurmckptError, EOFError) as e:
            if not quiet:
                say(self.env, f"cannot reach the job's coordinator ({e}): this task runs without checkpoints "
                              "until it can")
            return None

    def _rank_session(self) -> None:
        """Serve the coordinator's commands. A lost connection (the coordinator died or is being restarted)
        leaves no epoch half done here: the tree is thawed, then the task reconnects to the new one."""
        while self.client is not None:
            self.client.serve_forever()
            self._abandon_epoch()
            if self.exiting:
                return
            self.client = None
            say(self.env, "lost the job's coordinator; the task runs on and reconnects")
            while self.client is None and not self.exiting:
                time.sleep(1)
                found = self.call("lookup_coordinator", scope=self.scope, wait_s=0)
                if found.get("found"):
                    self.client = self._connect(found, quiet=True)
            if self.client is not None:
                say(self.env, f"reconnected to the job's coordinator at {found['host']}:{found['port']}")

    def _abandon_epoch(self) -> None:
        epoch, self.open_epoch = self.open_epoch, None
        if epoch is None:
            return
        self.final_capture.clear()
        try:
            self.call("abort", epoch=epoch)
            say(self.env, f"epoch {epoch} abandoned (its coordinator was lost mid-epoch): the task runs on, "
                          "the previous checkpoint stays the one restored")
        except (OSError, SlurmckptError, EOFError) as e:
            say(self.env, f"epoch {epoch} abandoned, but undoing it failed: {e}")

    def _host_coordinator(self, plan: dict, scope: str) -> None:
        token = new_token()
        single_node = os.environ.get("SLURM_JOB_NUM_NODES", "1") == "1"
        host = "127.0.0.1" if single_node else _reachable_address(self.env.node)
        settings = {"token": token, "next_epoch": plan["next_epoch"], "completed": dict(plan.get("completed", {})),
                    "prepare_timeout_s": self.config.prepare_timeout_s,
                    "capture_timeout_s": self.config.capture_timeout_s, "lock_rounds": self.config.gpu_lock_rounds}
        callbacks = HostCallbacks(
            commit=self._commit,
            publish=lambda port: self.call("publish_coordinator", scope=scope, host=host, port=port, token=token),
            started=self._on_rank_started, result=self._epoch_result, interval=self._set_host_interval,
            say=lambda text: say(self.env, text))
        self.supervisor = CoordinatorSupervisor(self.env.job_id, settings, callbacks)
        self.supervisor.start()
        self.schedule = Schedule.for_job(self.env, self.config)

    def _set_host_interval(self, seconds: int) -> None:
        self.host_interval = seconds
        os.write(self.wake_w, b"i")          # the supervise loop recomputes its timeout

    def _start(self, plan: dict) -> None:
        stdio = [0, 1, 2]
        for candidate in plan["candidates"]:
            kind, epoch = candidate["kind"], candidate["epoch"]
            if kind == "completed":
                say(self.env, f"already finished before the requeue (exit {candidate['exit_code']}); not rerun")
                self._started("skip")
                self.completed_code = int(candidate["exit_code"])
                return
            self._started("restore")
            try:
                t0 = time.monotonic()
                reply = self.call("restore", stdio, epoch=epoch)
            except SlurmckptError as e:
                if self._shares_cut():
                    self._withdraw(epoch, e)
                    return
                say(self.env, f"restore of checkpoint epoch {epoch} FAILED: {e}; falling back")
                continue
            if reply["kind"] == "replay":
                say(self.env, f"output restored from epoch {epoch}; re-running the batch script to re-launch "
                              "its steps (its output is suppressed until a step resumes)")
                self.gate.clear()
                self._launch(relay=True)
            else:
                self.root_pid = int(reply["pid"])
                say(self.env, f"restored from checkpoint epoch {epoch} in {time.monotonic() - t0:.2f}s "
                              f"(restart {self.env.restart_count})")
            return
        if plan["candidates"]:
            say(self.env, "no checkpoint could be restored: starting the task from the beginning")
        self._started("run")
        self._launch(relay=False)

    def _shares_cut(self) -> bool:
        """Other ranks restore the same epoch: falling back alone would leave the job at no common cut."""
        return self.client is not None and (self.env.step != "batch" or self.env.tasks > 1)

    def _withdraw(self, epoch: int, error: SlurmckptError) -> None:
        """Coordinated fallback: withdraw the epoch for every rank, stop the coordinator from committing the
        mixed state, and requeue the job: on the next start every rank restores the same older epoch."""
        say(self.env, f"restore of checkpoint epoch {epoch} FAILED: {error}; withdrawing epoch {epoch} for "
                      "every rank of the job and requeueing it, so that all ranks restart together from the "
                      "previous checkpoint")
        try:
            self.call("reject_epoch", epoch=epoch, reason=str(error))
            if self.client:
                self.client.event("withdrawn", wait_ack=False, epoch=epoch)
        except (OSError, SlurmckptError) as e:
            say(self.env, f"withdrawing epoch {epoch} failed ({e}); the job is requeued anyway")
        self.awaiting_requeue = True
        self._requeue()

    def _started(self, action: str) -> None:
        if self.client and self.env.step != "batch":
            self.client.event("started", wait_ack=True, action=action)

    def _launch(self, relay: bool) -> None:
        stdio = [0, 1, 2]
        if relay:
            stdio = [0] + [self._relay(fd) for fd in (1, 2)]
        env = {k: v for k, v in os.environ.items() if k not in PRIVATE and k != "SLURMCKPT_INTERVAL"}
        reply = self.call("launch", stdio, argv=self.argv, env=env, cwd=os.getcwd())
        if relay:
            for fd in stdio[1:]:
                os.close(fd)
        self.root_pid = int(reply["pid"])

    def _relay(self, target: int) -> int:
        """A pipe whose reader copies to `target` once the gate is open, discarding before that."""
        r, w = os.pipe()

        def pump() -> None:
            while block := os.read(r, 65536):
                if self.gate.is_set():
                    os.write(target, block)
            os.close(r)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.relays.append(t)
        return w

    # ---- supervision -----------------------------------------------------------------------------------
    def _supervise(self, wake_r: int) -> int:
        if self.awaiting_requeue:
            return self._wait_for_requeue()
        if getattr(self, "completed_code", None) is not None:
            return self._exit(self.completed_code)
        status: int | None = None
        while True:
            timeout = self.schedule.seconds_to_next(self._interval()) if self.schedule else None
            select.select([wake_r], [], [], timeout)
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            if self.schedule:
                for reason, final in self.schedule.due(self._interval()):
                    self.trigger(reason, final)
            while self.pending:
                sig = self.pending.pop(0)
                self._on_signal(sig)
            status = self._reap(status)
            if status is not None:
                if self.final_capture.is_set() and not self.final_committed.is_set():
                    self._await_final_commit()
                if self.final_committed.is_set():
                    return self._wait_for_requeue()
                return self._exit(status)

    def _interval(self) -> int:
        return min([v for v in (self.env.interval_s, self.host_interval)
                    if v > 0], default=0)

    def _reap(self, status: int | None) -> int | None:
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return status
            if pid == 0:
                return status
            if pid == self.root_pid:
                status = os.waitstatus_to_exitcode(raw)
                status = 128 - status if status < 0 else status
            elif self.supervisor:
                self.supervisor.reaped(pid, os.waitstatus_to_exitcode(raw))

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGCHLD:
            return
        if sig == signal.SIGTERM and self.agent_gone:
            self._signal_tree(signal.SIGTERM)     # no capture possible here: end like a plain Slurm task
            self.trigger("sigterm", True)          # (the job's final epoch aborts: previous commit stays)
        elif sig == signal.SIGTERM:
            if not self.final_committed.is_set():
                say(self.env, "SIGTERM from Slurm (preemption, requeue or time limit): capturing the job")
                self.trigger("sigterm", True)
        elif sig == CHECKPOINT_SIGNAL:
            self.trigger("manual", False)
        elif sig == REQUEUE_SIGNAL:
            self.trigger("manual-requeue", True)
        elif self.root_pid:
            try:
                os.kill(self.root_pid, sig)
            except ProcessLookupError:
                pass

    def trigger(self, reason: str, final: bool) -> None:
        """Ask for an epoch: the hosting wrapper tells its coordinator process; other ranks tell it over
        their connection."""
        if self.supervisor:
            self.supervisor.trigger(reason, final)
        elif self.client:
            try:
                self.client.event("trigger", reason=reason, final=final)
            except OSError as e:
                say(self.env, f"cannot reach the coordinator to capture ({e})")

    def _epoch_result(self, result: dict, reason: str, final: bool) -> None:
        if result["status"] == "committed":
            say(self.env, f"checkpoint epoch {result['epoch']} committed ({reason}): {result['ranks']} rank(s), "
                          f"{result['bytes'] / 2**20:.1f} MiB, frozen->committed {result['commit_s']:.2f}s, "
                          f"consistent cut after {result.get('cut_s', 0):.3f}s in {result.get('lock_rounds', 1)} "
                          "round(s)")
            if self.schedule:
                self.schedule.captured(result["commit_s"])
            if final and reason in ("walltime", "manual-requeue"):
                threading.Thread(target=self._requeue, daemon=True).start()
        elif result["status"] == "aborted":
            where = f"rank {result.get('rank', '?')} on node {result.get('node', '?')}"
            say(self.env, f"checkpoint epoch {result['epoch']} ({reason}) ABORTED at {result.get('stage')} "
                          f"({where}): {result.get('error')}; the previous checkpoint stays the one restored")

    def _requeue(self) -> None:
        from slurmckpt.slurm.control import default_control
        try:
            default_control().requeue(self.env.job_id)
            say(self.env, "job requeued; it resumes from this checkpoint when it starts again")
        except SlurmckptError as e:
            say(self.env, f"requeue failed: {e}")

    def _on_command(self, kind: str, epoch: int, message: dict) -> dict:
        self.last_epoch = max(self.last_epoch, epoch)
        if self.supervisor:
            self.supervisor.saw_epoch(epoch)
        if kind == "prepare":
            self.open_epoch = epoch
        elif kind in ("resume", "abort", "finish"):
            self.open_epoch = None
        if kind == "finish":
            self.final_committed.set()
        elif kind == "capture" and message.get("final", True):
            self.final_capture.set()
        elif kind == "abort":
            self.final_capture.clear()
        args = {"final": bool(message.get("final", True))} if kind == "capture" else {}
        return {k: v for k, v in self.call(kind, epoch=epoch, **args).items() if k != "ok"}

    def _on_rank_started(self, rank: str, action: str) -> None:
        if action in ("restore", "run"):
            self.gate.set()

    def _commit(self, epoch: int, ranks: dict, reason: str) -> None:
        self.call("commit", epoch=epoch, ranks=ranks, reason=reason)

    def _await_final_commit(self) -> None:
        """The tree ended because a final capture dumped it: its epoch decides (commit or abort)."""
        deadline = time.monotonic() + self.config.capture_timeout_s + 60
        while self.final_capture.is_set() and not self.final_committed.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _wait_for_requeue(self) -> int:
        """After a final capture the job must not go on (the batch script would continue, or the job would
        complete): wait until Slurm is ending the job (requeue, or the end of a preemption's GraceTime)."""
        from slurmckpt.slurm.control import CliSlurm
        say(self.env, "captured for requeue; waiting for Slurm to requeue the job")
        deadline = time.monotonic() + self.config.requeue_wait_s
        while time.monotonic() < deadline:
            try:
                if CliSlurm(timeout_s=10).job(self.env.job_id).get("job_state") != "RUNNING":
                    return 0          # Slurm is already taking the job down; nothing of it runs on
            except SlurmckptError:
                return 0
            time.sleep(1)
        say(self.env, "no requeue came; exiting (the checkpoint stays available)")
        return 0

    def _signal_tree(self, sig: int) -> None:
        """Every process of the tree (its cgroup), for when its root agent is gone."""
        procs = os.path.join(os.path.dirname(self.thaw_control or "/nonexistent"), "cgroup.procs")
        try:
            pids = [int(p) for p in open(procs).read().split()]
        except OSError:
            pids = [self.root_pid] if self.root_pid else []
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _exit(self, status: int) -> int:
        self.exiting = True
        if self.agent_gone:                 # nobody else ends what is left of the tree
            self._signal_tree(signal.SIGKILL)
        if self.client:
            try:
                self.client.event("exited", exit_code=status)
            except OSError:
                pass
        for t in self.relays:
            t.join(5)
        if self.supervisor:
            self.supervisor.stop()
        return status


def _reachable_address(node: str) -> str:
    """The address other nodes reach this one at: Slurm's NodeAddr for it, else the default route's
    source address (a UDP connect sends nothing), else loopback."""
    import subprocess
    try:
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True,
                             timeout=10).stdout
        for word in out.split():
            if word.startswith("NodeAddr="):
                return socket.gethostbyname(word.split("=", 1)[1])
    except (OSError, subprocess.TimeoutExpired):
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def main() -> None:
    env = TaskEnv.from_environ()
    argv = ([env.argv0] + sys.argv[1:]) if env.argv0 else sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit("slurmckpt-wrap: no command to run")
    if env.agent_fd is None:
        say(env, "no agent (plugin not active for this task): running the command without checkpoints")
        os.execvp(argv[0], argv)
    logging.basicConfig(level=logging.WARNING, format="slurmckpt %(name)s: %(message)s")
    try:
        code = Wrapper(env, argv).run()
    except SlurmckptError as e:
        say(env, f"fatal: {e}")
        code = 1
    sys.stdout.flush()
    os._exit(code)
