"""How the wrapper starts its task (task/wrapper.py composes it): restore the newest committed epoch that
holds it, fall back to an older one or withdraw an epoch for the whole job, or run the command afresh, and
launch it with the defaults a checkpointable job needs."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from slurmckpt.config import Config
from slurmckpt.cuda.release import release as driver_release
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm import pmi
from slurmckpt.slurm.env import PRIVATE, TaskEnv
from slurmckpt.task import defaults as task_defaults
from slurmckpt.task.membership import Membership
from slurmckpt.task.srun_relay import SrunRelay

# Slurm 26.05 gives every run a new SLURM_JOB_SLUID: a restored process still has the captured run's
# (slurm/run_env.py)
ENV_NOTE = ("; its processes keep the environment of the run they were captured in (SLURM_JOB_SLUID, "
            "SLURM_RESTART_COUNT...): `slurmckpt env` prints this run's")

log = logging.getLogger("slurmckpt.wrapper")


Call = Callable[..., dict[str, Any]]


class TaskStart:
    """The task's start; its own state: the tree's root pid, the exit code of a rank that had finished
    before the capture, the fresh-start line said, a withdrawn epoch awaiting the requeue, and the gate
    that holds a replayed batch script's output back until a step resumes."""

    def __init__(self, argv: list[str], config: Config, call: Call, say: Callable[[str], None],
                 member: Membership, requeue: Callable[[], None], pmi_fd: int | None) -> None:
        """`call`: the agent's operations; `requeue`: the job's requeue (task/epochs.py); `pmi_fd`: the
        task's PMI socket to slurmstepd (srun --mpi=pmi2), which goes into the tree only through
        pmi.Handover."""
        self.argv, self.config, self.call, self._say, self.member = argv, config, call, say, member
        self.requeue, self.pmi_fd = requeue, pmi_fd
        self.root_pid: int | None = None
        self.completed_code: int | None = None   # the task had finished before the capture: its exit code
        self.fresh_notice: str | None = None     # why a requeued batch step starts from the beginning
        self.awaiting_requeue = False            # a coordinated fallback asked Slurm to restart the job
        self.gate = threading.Event()            # replayed batch output passes once a step resumes
        self.gate.set()
        self.relays: list[threading.Thread] = []

    def start(self, plan: dict[str, Any], env: TaskEnv, srun_relay: SrunRelay | None) -> None:
        """`env`: the task's, as its plan left it; `srun_relay`: the batch step's (srun_relay.py)."""
        stdio = [0, 1, 2]
        failed: list[str] = []       # epochs that did not restore, said again once an older one has
        if self.pmi_fd is not None:      # the agent dumps it as external and restores this one in its place
            self.call("pmi_socket", [self.pmi_fd])
        for candidate in plan["candidates"]:
            kind, epoch = candidate["kind"], candidate["epoch"]
            if kind == "completed":
                self._say(f"already finished before the requeue (exit {candidate['exit_code']}); not rerun")
                self._started(env, "skip")
                self.completed_code = int(candidate["exit_code"])
                return
            self._started(env, "restore")
            try:
                t0 = time.monotonic()
                reply = self._restore(env, srun_relay, stdio, epoch)
            except SlurmckptError as e:
                if self._shares_cut(env):
                    self._withdraw(epoch, e)
                    return
                self._say(f"restore of checkpoint epoch {epoch} FAILED: {e}; falling back")
                failed.append(f"epoch {epoch}: {(str(e).splitlines() or [type(e).__name__])[0][:300]}")
                continue
            if reply["kind"] == "replay":
                self._say(f"output restored from epoch {epoch}; re-running the batch script to re-launch "
                              "its steps (its output is suppressed until a step resumes)")
                self.gate.clear()
                self.launch(env, srun_relay, relay=True)
            else:
                self.root_pid = int(reply["pid"])
                note = ENV_NOTE if "SLURM_JOB_SLUID" in os.environ else ""
                cost = str(candidate.get("cost") or "")[:600]     # what the requeue cost (store/handover.py)
                self._say(f"restored from checkpoint epoch {epoch} in {time.monotonic() - t0:.2f}s "
                          f"(restart {env.restart_count}){': ' + cost if cost else ''}{note}")
            if failed:     # the restore put back this epoch's output, which ends before the FAILED lines
                self._say(f"epoch {epoch} was restored because newer checkpoints could not be: "
                          + "; ".join(failed))
            return
        if env.step == "batch":
            self._say_fresh_start()
        elif plan["candidates"]:
            self._say("no checkpoint could be restored: starting the task from the beginning")
        self._started(env, "run")
        self.launch(env, srun_relay, relay=False)

    def _say_fresh_start(self) -> None:
        """A requeued job that restored nothing says why, before its first output (Slurm truncated the
        output file at the requeue); the agent composes the line and sets the job's AdminComment to it."""
        try:
            self.fresh_notice = self.call("fresh_start").get("notice")
        except SlurmckptError as e:
            self.fresh_notice = f"starting from the beginning: the reason could not be learnt ({e})"
        if self.fresh_notice:
            self._say(self.fresh_notice)

    def _restore(self, env: TaskEnv, srun_relay: SrunRelay | None, stdio: list[int], epoch: int) -> dict[str, Any]:
        """The batch step also hands over its script (the spool path differs on another node)."""
        script = -1
        if env.step == "batch" and self.argv:
            try:
                script = os.open(self.argv[0], os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                script = -1
        pairs = self._standin_sockets(env, srun_relay, epoch)
        try:
            reply = self.call("restore", stdio + ([script] if script >= 0 else []) + [b.fileno() for _, b in pairs],
                              epoch=epoch, **({"standins": len(pairs)} if pairs else {}))
        except BaseException:
            for a, _ in pairs:
                a.close()
            raise
        finally:
            if script >= 0:
                os.close(script)
            for _, b in pairs:
                b.close()
        for a, _ in pairs:       # the restored stand-ins ask for their srun again
            assert srun_relay is not None
            srun_relay.adopt(a)
        return reply

    def _standin_sockets(self, env: TaskEnv, srun_relay: SrunRelay | None,
                         epoch: int) -> list[tuple[socket.socket, socket.socket]]:
        """One new socket pair per srun stand-in in the checkpoint: one end replaces the stand-in's old
        socket (criu --inherit-fd), the other is served here (srun_relay.py)."""
        if env.step != "batch" or srun_relay is None:   # the agent refuses a checkpoint that
            return []                                               # holds some: none handed in
        count = int(self.call("standins", epoch=epoch).get("count", 0))
        return [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(count)]

    def _shares_cut(self, env: TaskEnv) -> bool:
        """Other ranks restore the same epoch: falling back alone would leave the job at no common cut."""
        return self.member.connected and (env.step != "batch" or env.tasks > 1)

    def _withdraw(self, epoch: int, error: SlurmckptError) -> None:
        """Coordinated fallback: withdraw the epoch for every rank, stop the coordinator from committing the
        mixed state, and requeue the job: on the next start every rank restores the same older epoch."""
        self._say(f"restore of checkpoint epoch {epoch} FAILED: {error}; withdrawing epoch {epoch} for "
                      "every rank of the job and requeueing it, so that all ranks restart together from the "
                      "previous checkpoint")
        try:
            self.call("reject_epoch", epoch=epoch, reason=str(error))
        except SlurmckptError as e:
            self._say(f"withdrawing epoch {epoch} failed ({e}); the job is requeued anyway")
        self.member.event("withdrawn", epoch=epoch)
        self.awaiting_requeue = True
        self.requeue()

    def _started(self, env: TaskEnv, action: str) -> None:
        if env.step != "batch":
            self.member.event("started", wait_ack=True, action=action)

    def launch(self, env: TaskEnv, srun_relay: SrunRelay | None, relay: bool) -> None:
        """The task's command started as a new tree, with what a checkpointable job needs set (docs/gpu.md);
        `relay`: a replayed batch script, its output held back by the gate."""
        stdio = [0, 1, 2]
        if relay:
            stdio = [0] + [self._relay(fd) for fd in (1, 2)]
        tree_env = {k: v for k, v in os.environ.items() if k not in PRIVATE and k != "SLURMCKPT_INTERVAL"}
        if srun_relay:
            tree_env = srun_relay.tree_env(tree_env)
        # docs/gpu.md, "What slurmckpt sets in a checkpointed job" (recomputed for a step: not inherited)
        tree_env = task_defaults.without_inherited(tree_env)
        launch = task_defaults.defaults(tree_env, self.config, driver_release())
        added = launch.env
        argv = [*launch.argv_prefix, *self.argv]
        tree_env.update({**added, **task_defaults.marked(added)})
        if task_defaults.uses_gpus(tree_env) and (added or launch.argv_prefix) and env.rank == 0:  # once a step
            self._say("checkpointable GPU job: set " + " ".join(f"{k}={v}" for k, v in sorted(added.items()))
                      + (f"; started under {' '.join(launch.argv_prefix)}" if launch.argv_prefix else "")
                      + " (a job's own value stands; docs/gpu.md, \"What slurmckpt sets in a checkpointed job\")")
        trade = launch.transports.line(env.node) if launch.transports else None
        if trade and os.environ.get("SLURM_LOCALID", "0") == "0":     # once a node and step
            self._say(trade)
        allow_io_uring, complaint = task_defaults.io_uring_wanted(tree_env)
        if complaint and env.rank == 0:
            self._say(complaint)
        if self.pmi_fd is not None and not relay:
            tree_env[pmi.HANDOVER] = pmi.Handover(self.pmi_fd).name
            tree_env = pmi.rank_env(tree_env)      # in its own PID namespace: no shared memory with the node's ranks
            argv = pmi.attach_argv(argv)
        reply = self.call("launch", stdio, argv=argv, env=tree_env, cwd=os.getcwd(), allow_io_uring=allow_io_uring)
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

    def rank_started(self, rank: str, action: str) -> None:
        """A rank of the job started (the coordinator's word): a replayed batch script's output passes."""
        if action in ("restore", "run"):
            self.gate.set()
