"""The task wrapper (runs as the job's user): slurmstepd execs it in place of the task's command.

It asks its root agent to start the command as a checkpointable tree (or to restore the newest committed
checkpoint), stays the tree's parent (PR_SET_CHILD_SUBREAPER), forwards signals, turns Slurm's SIGTERM into a
final capture, takes part in the job's epochs through the coordinator, and exits with the workload's code.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from slurmckpt.slurm import pmi
from slurmckpt.node import procfs
from slurmckpt.node import proctree
from slurmckpt.channel import Channel
from slurmckpt.config import load_user_config
from slurmckpt.task.membership import HostEvents, Membership
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.env import PRIVATE, TaskEnv
from slurmckpt.task.srun_relay import STEP_TOKEN, SrunRelay
from slurmckpt.task.schedule import CHECKPOINT_SIGNAL, REQUEUE_SIGNAL
from slurmckpt.task.epochs import EpochHandling, with_interval
from slurmckpt.task.start import TaskStart

log = logging.getLogger("slurmckpt.wrapper")

PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
             signal.SIGWINCH, signal.SIGCONT)
# how long a signal for the task's root is tried again while that process is not yet the job's user's
PASS_ON_RETRY_S = 2.0


def pass_signal(pid: int, sig: int) -> None:
    """A signal for the task's root. Right after the launch that process may still be the root agent's
    fork, before setpriv made it the job's user's (milliseconds): the kill is refused (EPERM) then, and
    tried again; a process gone is nothing to do. Never a traceback in the job's output."""
    deadline = time.monotonic() + PASS_ON_RETRY_S
    while True:
        try:
            os.kill(pid, sig)
            return
        except ProcessLookupError:
            return
        except PermissionError:
            if time.monotonic() >= deadline:
                log.warning("signal %d not passed on: pid %d is not the job's user's", sig, pid)
                return
            time.sleep(0.01)


def say(env: TaskEnv, message: str) -> None:
    """One line in the job's stderr: users see what slurmckpt did to their job."""
    stamp = time.strftime("%H:%M:%S")
    os.write(2, f"slurmckpt[{stamp} job {env.job_id} {env.rank_name}]: {message}\n".encode())


class Wrapper:
    """The life of the task: its agent channel, signals, the tree's end and the exit code. It composes the
    task's start (task/start.py: restore or run, the tree's root pid) and its side of the job's epochs
    (task/epochs.py), and owns the task's environment, which the plan may rename (a relayed srun's step) and
    the policy re-time (its interval)."""

    def __init__(self, env: TaskEnv, argv: list[str]) -> None:
        self.env, self.argv = env, argv
        self.config = load_user_config()
        assert env.agent_fd is not None
        os.set_inheritable(env.agent_fd, False)          # the workload never gets the agent's socket
        self.agent = Channel.from_fd(env.agent_fd)
        self.agent_lock = threading.Lock()
        self.agent_gone = False
        self.ending = False                  # the task is done: the agent channel is closed on purpose
        # the wrapper passed Slurm's SIGTERM on to the tree (no capture was possible): its end that follows
        # is no completion of the program
        self.passed_sigterm_on = False
        # Slurm's SIGTERM reached this task; the coordinator said the job's final capture failed (either may
        # come first): both, and the SIGTERM goes on to the program
        self.sigterm_lock = threading.Lock()
        self.got_sigterm = self.final_failed = False
        self.tree_procs: str | None = None     # the tree's cgroup.procs: ends the tree if the agent is gone
        self.pending: list[int] = []
        self.epochs = EpochHandling(self.config, self.call, self._say, env.job_id, self._pass_sigterm_on,
                                    self._final_capture_failed)
        self.member = Membership(env, self.config, self.call, self.epochs.on_command, lambda text: say(env, text))
        # srun --mpi=pmi2: the task's socket to slurmstepd goes into the tree only through pmi.Handover
        pmi_fd = pmi.task_socket(dict(os.environ)) if env.step != "batch" else None
        if pmi_fd is not None:
            os.set_inheritable(pmi_fd, False)
        self.task = TaskStart(argv, self.config, self.call, self._say, self.member, self.epochs.requeue, pmi_fd)
        # the batch step: an MPI launcher's srun runs here, outside the tree (srun_relay.py)
        self.srun_relay: SrunRelay | None = None

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict[str, Any]:
        with self.agent_lock:
            try:
                return self.agent.call(op, fds, **args)
            except (EOFError, OSError) as e:
                if not self.ending:
                    self._agent_lost(op)
                raise SlurmckptError(f"the task's root agent is gone ({e})", op=op) from e

    def _say(self, text: str) -> None:
        say(self.env, text)

    def trigger(self, reason: str, final: bool) -> None:
        self.member.trigger(reason, final)

    def _agent_lost(self, op: str) -> None:
        """The root agent died (killed, crashed). Without it nothing can be captured or restored here; its
        watchdog (watchdog.py) thaws the tree if it was frozen, the freeze control being root's alone."""
        if self.agent_gone:
            return
        self.agent_gone = True
        say(self.env, f"the task's root agent died (during {op}); its watchdog thaws the tree: the task runs "
                      "on, but can take no part in checkpoints; the last committed checkpoint stays the one "
                      "restored")

    # ---- start ---------------------------------------------------------------------------------------
    def run(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        for sig in (*FORWARDED, signal.SIGTERM, signal.SIGCHLD, CHECKPOINT_SIGNAL, REQUEUE_SIGNAL):
            signal.signal(sig, lambda s, f: self.pending.append(s))
        token = os.environ.get(STEP_TOKEN, "") if self.env.step != "batch" else ""
        asked: dict[str, Any] = {"token": token} if token else {}
        plan = self.call("plan", **asked)
        if plan.get("disabled"):
            self._run_plainly(libc, str(plan["disabled"]))
        if isinstance(plan.get("step"), str) and plan["step"] != self.env.step:   # srun run again for a
            self.env = dataclasses.replace(self.env, step=plan["step"])          # restored launcher
            self.member.env = self.env
        if self.env.step == "batch":
            self.srun_relay = SrunRelay.start(plan.get("srun_relay"), self.config.srun_standin_dir, self.call,
                                              lambda text: say(self.env, text))
        self.env = self.member.env = with_interval(plan, self.env, self._say)
        self.tree_procs = plan.get("tree_procs")
        self.member.join(plan, HostEvents(started=self.task.rank_started, result=self.epochs.epoch_result,
                                          interval=self.epochs.interval_chosen))
        if self.member.supervisor:
            self.epochs.schedule_job(self.env)
        self.task.start(plan, self.env, self.srun_relay)
        if plan.get("warning") and not self.task.fresh_notice:  # the agent's word on what it did not restore;
            say(self.env, str(plan["warning"]))             # after a restore rewrote the output
        code = self._supervise(wake_r)
        self.member.stop()
        if self.srun_relay:
            self.srun_relay.close()
        with self.agent_lock:
            self.ending = True
            self.agent.close()          # the agent ends what is left of the tree and exits
        self._reap_children(2.0)
        return code

    def _run_plainly(self, libc: ctypes.CDLL, why: str) -> None:
        """The site policy forbids checkpoints for this job: the task becomes its own command, as without the
        plugin (the agent sees its channel close on the exec and exits)."""
        say(self.env, f"{why}: running the task without checkpoints")
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        env = {k: v for k, v in os.environ.items() if k not in PRIVATE and k != "SLURMCKPT_INTERVAL"}
        os.execvpe(self.argv[0], self.argv, env)

    def _reap_children(self, timeout_s: float) -> None:
        """Leave no zombie behind: one that outlived its parent in the tree was re-parented here, and as a
        zombie it keeps its session id (the tree root's pid) busy."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)

    # ---- supervision -----------------------------------------------------------------------------------
    def _supervise(self, wake_r: int) -> int:
        if self.task.awaiting_requeue:
            return self._wait_for_requeue("epoch withdrawn; waiting for Slurm to requeue the job")
        if self.task.completed_code is not None:
            return self._exit(self.task.completed_code)
        status: int | None = None
        schedule = self.epochs.schedule
        while True:
            timeout = schedule.seconds_to_next() if schedule else None
            select.select([wake_r], [], [], timeout)
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            if schedule:
                for reason, final in schedule.due():
                    self.trigger(reason, final)
            while self.pending:
                sig = self.pending.pop(0)
                self._on_signal(sig)
            status = self._reap(status)
            if status is not None:
                if self.epochs.final_capture.is_set() and not self.epochs.final_committed.is_set():
                    self.epochs.await_final_commit()
                if self.epochs.final_committed.is_set():
                    return self._wait_for_requeue()
                return self._exit(status)

    def _reap(self, status: int | None) -> int | None:
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return status
            if pid == 0:
                return status
            if pid == self.task.root_pid:
                status = os.waitstatus_to_exitcode(raw)
                status = 128 - status if status < 0 else status
            elif self.srun_relay and self.srun_relay.reaped(pid, os.waitstatus_to_exitcode(raw)):
                pass
            else:
                self.member.reaped(pid, os.waitstatus_to_exitcode(raw))

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGCHLD:
            return
        if sig == signal.SIGTERM and self.agent_gone:
            self.passed_sigterm_on = True
            self._signal_tree(signal.SIGTERM)     # no capture possible here: end like a plain Slurm task
            self.trigger("sigterm", True)          # (the job's final epoch aborts: previous commit stays)
        elif sig == signal.SIGTERM:
            with self.sigterm_lock:
                self.got_sigterm, failed = True, self.final_failed
            if failed:       # the job's final capture failed before this task's SIGTERM was handled
                self._pass_on_after_failed_final()
            elif not self.epochs.final_committed.is_set():
                say(self.env, "SIGTERM from Slurm (preemption, requeue or time limit): capturing the job")
                self.trigger("sigterm", True)
        elif sig == CHECKPOINT_SIGNAL:
            self.trigger("manual", False)
        elif sig == REQUEUE_SIGNAL:
            self.trigger("manual-requeue", True)
        elif self.task.root_pid:
            pass_signal(self.task.root_pid, sig)

    def _wait_for_requeue(self, why: str = "captured for requeue; waiting for Slurm to requeue the job") -> int:
        """After a final capture the job must not go on (the batch script would continue, or the job would
        complete): wait until Slurm is ending the job (requeue, or the end of a preemption's GraceTime)."""
        from slurmckpt.slurm.control import CliSlurm
        from slurmckpt.slurm.jobrecord import state_words
        say(self.env, why)
        deadline = time.monotonic() + self.config.requeue_wait_s
        while time.monotonic() < deadline:
            try:      # the base state: 22.05 "RUNNING", 23.02+ ["RUNNING", flags...]
                if state_words(CliSlurm(timeout_s=10).job(self.env.job_id).get("job_state"))[0] != "RUNNING":
                    return 0          # Slurm is already taking the job down; nothing of it runs on
            except SlurmckptError:
                return 0
            time.sleep(1)
        say(self.env, "no requeue came; exiting (the checkpoint stays available)")
        return 0

    def _tree_pids(self) -> list[int]:
        try:
            return [int(p) for p in open(self.tree_procs or "/nonexistent").read().split()]
        except OSError:
            return [self.task.root_pid] if self.task.root_pid else []

    def _signal_tree(self, sig: int, pids: list[int] | None = None) -> None:
        """Every process of the tree (its cgroup): when its root agent is gone, or a final capture failed."""
        for pid in self._tree_pids() if pids is None else pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _final_capture_failed(self) -> None:
        """The coordinator's word: the job's final capture at Slurm's SIGTERM failed. A task that got the
        signal passes it on now; one that did not yet, when it comes (_on_signal)."""
        with self.sigterm_lock:
            self.final_failed, got = True, self.got_sigterm
        if got:
            self._pass_on_after_failed_final()

    def _pass_on_after_failed_final(self) -> None:
        if not self.member.supervisor:     # the host says it with the epoch's result (task/epochs.py)
            self._say("the job's final capture failed: passing Slurm's SIGTERM on to the program")
        threading.Thread(target=self._pass_sigterm_on, daemon=True).start()

    def _pass_sigterm_on(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every process of the tree, once. The namespace init ends when its root child (the batch
        script, the task's program) does, and the kernel then kills the whole namespace: so the other
        processes get it first and up to `grace_s` to act on it (their own handlers), the root child and
        the init after. Slurm's SIGKILL after KillWait bounds it all."""
        with self.sigterm_lock:
            if self.passed_sigterm_on:
                return
            self.passed_sigterm_on = True
        pids = self._tree_pids()
        root = self.task.root_pid
        top = {root, *proctree.children_map().get(root, [])} if root else set()
        rest = [p for p in pids if p not in top]
        self._signal_tree(signal.SIGTERM, rest)
        deadline = time.monotonic() + grace_s
        while any(_running(p) for p in rest) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal_tree(signal.SIGTERM, [p for p in pids if p in top])

    def _exit(self, status: int) -> int:
        if self.agent_gone:                 # nobody else ends what is left of the tree
            self._signal_tree(signal.SIGKILL)
        killed_for = self._killed_by_agent()
        if killed_for:
            say(self.env, f"the task was killed by slurmckpt ({killed_for}); the previous checkpoint stays the "
                          f"one restored: scontrol requeue {self.env.job_id} restores it")
        # A program ended by the SIGTERM passed on here, or killed by its agent, is not recorded as completed
        # (a later capture would restore the rank as that exit code while its peers restore mid-run): it
        # just leaves the job, a capture without it cannot commit, and the previous commit stays the one
        # restored.
        self.member.close(status, completed=not (self.passed_sigterm_on or killed_for))
        for t in self.task.relays:
            t.join(5)
        return status

    def _killed_by_agent(self) -> str:
        if self.agent_gone:
            return ""
        try:
            return str(self.call("tree_fate").get("killed_for") or "")
        except SlurmckptError:
            return ""


def _running(pid: int) -> bool:
    try:
        return procfs.stat(pid).state != "Z"
    except (OSError, ValueError, IndexError):
        return False


def task_argv(env: TaskEnv, args: list[str]) -> list[str]:
    """The task's command from the wrapper's own arguments, by launch form (docs/contracts.md): Slurm >= 23.02.5
    prepends the wrapper (SLURMCKPT_TASK_ARGV=prepended: `args` is the task's argv as it was), older Slurm
    replaces argv[0] (SLURMCKPT_TASK_ARGV0 holds it), by hand it is `slurmckpt-wrap [--] CMD ARGS...`."""
    if env.argv_form is not None:
        if env.argv_form != "prepended" or env.argv0 is not None:
            raise SlurmckptError(f"unknown launch form SLURMCKPT_TASK_ARGV={env.argv_form!r}"
                                 + (" with SLURMCKPT_TASK_ARGV0 set" if env.argv0 is not None else ""))
        argv = list(args)
    elif env.argv0:
        argv = [env.argv0] + args
    else:
        argv = args[1:] if args[:1] == ["--"] else list(args)
    if not argv:
        raise SlurmckptError("no command to run")
    return argv


def main() -> None:
    env = TaskEnv.from_environ()
    try:
        argv = task_argv(env, sys.argv[1:])
    except SlurmckptError as e:
        sys.exit(f"slurmckpt-wrap: {e}")
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
