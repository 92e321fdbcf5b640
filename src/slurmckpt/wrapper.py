"""The task wrapper (runs as the job's user): slurmstepd execs it in place of the task's command.

It asks its root agent to start the command as a checkpointable tree (or to restore the newest committed
checkpoint), stays the tree's parent (PR_SET_CHILD_SUBREAPER), forwards signals, turns Slurm's SIGTERM into a
final capture, takes part in the job's epochs through the coordinator, and exits with the workload's code.
"""
from __future__ import annotations

import asyncio
import ctypes
import fcntl
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
from slurmckpt.coordinator.server import Coordinator
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
        self.coordinator: Coordinator | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: RankClient | None = None
        self.schedule: Schedule | None = None
        self.pending: list[int] = []
        self.relays: list[threading.Thread] = []

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict:
        with self.agent_lock:
            return self.agent.call(op, fds, **args)

    # ---- start ---------------------------------------------------------------------------------------
    def run(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (*FORWARDED, signal.SIGTERM, signal.SIGCHLD, CHECKPOINT_SIGNAL, REQUEUE_SIGNAL):
            signal.signal(sig, lambda s, f: self.pending.append(s))
        plan = self.call("plan")
        self._join_coordinator(plan)
        self._start(plan)
        return self._supervise(wake_r)

    def _join_coordinator(self, plan: dict) -> None:
        host_scope = "job" if self.env.step == "batch" else None
        found = self.call("lookup_coordinator", scope="job", wait_s=0 if host_scope else 3)
        if not found["found"] and self.env.step != "batch":
            if self.env.rank == 0:
                host_scope = self.env.step
            else:
                found = self.call("lookup_coordinator", scope=self.env.step, wait_s=60)
        if host_scope:
            found = self._host_coordinator(plan, host_scope)
        if not found.get("found", True):
            say(self.env, "no coordinator found: this task runs without checkpoints")
            return
        try:
            self.client = RankClient(found["host"], found["port"], found["token"], self.env.rank_name,
                                     self.env.node, self.env.interval_s, self._on_command, self.env.tasks)
        except (OSError, SlurmckptError, EOFError) as e:
            say(self.env, f"cannot reach the job's coordinator ({e}): this task runs without checkpoints")
            return
        threading.Thread(target=self.client.serve_forever, name="coordinator-client", daemon=True).start()

    def _host_coordinator(self, plan: dict, scope: str) -> dict:
        token = new_token()
        self.loop = asyncio.new_event_loop()
        self.coordinator = Coordinator(token, self._commit, plan["next_epoch"], dict(plan.get("completed", {})),
                                       self.config.prepare_timeout_s, self.config.capture_timeout_s,
                                       on_started=self._on_rank_started, on_trigger=self.trigger,
                                       lock_rounds=self.config.gpu_lock_rounds)
        ready = threading.Event()
        port_box: list[int] = []

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            port_box.append(self.loop.run_until_complete(self.coordinator.start()))
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, name="coordinator", daemon=True).start()
        ready.wait(10)
        single_node = os.environ.get("SLURM_JOB_NUM_NODES", "1") == "1"
        host = "127.0.0.1" if single_node else _reachable_address(self.env.node)
        self.call("publish_coordinator", scope=scope, host=host, port=port_box[0], token=token)
        self.schedule = Schedule.for_job(self.env, self.config)
        return {"found": True, "host": host, "port": port_box[0], "token": token}

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
        return min([v for v in (self.env.interval_s, self.coordinator.interval_s if self.coordinator else 0)
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

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGCHLD:
            return
        if sig == signal.SIGTERM:
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
        """Ask for an epoch: the host runs it; other ranks tell the coordinator."""
        if self.coordinator and self.loop:
            future = asyncio.run_coroutine_threadsafe(self.coordinator.run_epoch(reason, final), self.loop)
            future.add_done_callback(lambda f: self._epoch_done(f, reason, final))
        elif self.client:
            try:
                self.client.event("trigger", reason=reason, final=final)
            except OSError as e:
                say(self.env, f"cannot reach the coordinator to capture ({e})")

    def _epoch_done(self, future, reason: str, final: bool) -> None:
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 - reported, the job runs on
            say(self.env, f"checkpoint ({reason}) crashed: {e}")
            return
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
            say(self.env, f"checkpoint epoch {result['epoch']} ({reason}) ABORTED at {result.get('stage')} "
                          f"(rank {result.get('rank', '?')}): {result.get('error')}; the previous checkpoint "
                          "stays the one restored")

    def _requeue(self) -> None:
        from slurmckpt.slurm.control import default_control
        try:
            default_control().requeue(self.env.job_id)
            say(self.env, "job requeued; it resumes from this checkpoint when it starts again")
        except SlurmckptError as e:
            say(self.env, f"requeue failed: {e}")

    def _on_command(self, kind: str, epoch: int, message: dict) -> dict:
        if kind == "finish":
            self.final_committed.set()
        elif kind == "capture" and message.get("final", True):
            self.final_capture.set()
        elif kind == "abort":
            self.final_capture.clear()
        args = {"final": bool(message.get("final", True))} if kind == "capture" else {}
        return {k: v for k, v in self.call(kind, epoch=epoch, **args).items() if k != "ok"}

    def _on_rank_started(self, rank: str, action: str):
        async def opened() -> None:
            if action in ("restore", "run") and not self.gate.is_set():
                self.gate.set()
        return opened()

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

    def _exit(self, status: int) -> int:
        if self.client:
            try:
                self.client.event("exited", exit_code=status)
            except OSError:
                pass
        for t in self.relays:
            t.join(5)
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
