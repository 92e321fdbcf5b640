"""How the wrapper starts its task (task/wrapper.py runs it): restore the newest committed epoch that holds
it, fall back to an older one or withdraw an epoch for the whole job, or run the command afresh."""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from slurmckpt.errors import SlurmckptError
from slurmckpt.task.parts import WrapperParts

# Slurm 26.05 gives every run a new SLURM_JOB_SLUID: a restored process still has the captured run's
# (slurm/run_env.py)
ENV_NOTE = ("; its processes keep the environment of the run they were captured in (SLURM_JOB_SLUID, "
            "SLURM_RESTART_COUNT...): `slurmckpt env` prints this run's")

log = logging.getLogger("slurmckpt.wrapper")


class TaskStart(WrapperParts):
    def _start(self, plan: dict[str, Any]) -> None:
        stdio = [0, 1, 2]
        failed: list[str] = []       # epochs that did not restore, said again once an older one has
        if self.pmi_fd is not None:      # the agent dumps it as external and restores this one in its place
            self.call("pmi_socket", [self.pmi_fd])
        for candidate in plan["candidates"]:
            kind, epoch = candidate["kind"], candidate["epoch"]
            if kind == "completed":
                self._say(f"already finished before the requeue (exit {candidate['exit_code']}); not rerun")
                self._started("skip")
                self.completed_code = int(candidate["exit_code"])
                return
            self._started("restore")
            try:
                t0 = time.monotonic()
                reply = self._restore(stdio, epoch)
            except SlurmckptError as e:
                if self._shares_cut():
                    self._withdraw(epoch, e)
                    return
                self._say(f"restore of checkpoint epoch {epoch} FAILED: {e}; falling back")
                failed.append(f"epoch {epoch}: {(str(e).splitlines() or [type(e).__name__])[0][:300]}")
                continue
            if reply["kind"] == "replay":
                self._say(f"output restored from epoch {epoch}; re-running the batch script to re-launch "
                              "its steps (its output is suppressed until a step resumes)")
                self.gate.clear()
                self._launch(relay=True)
            else:
                self.root_pid = int(reply["pid"])
                note = ENV_NOTE if "SLURM_JOB_SLUID" in os.environ else ""
                cost = str(candidate.get("cost") or "")[:600]     # what the requeue cost (store/handover.py)
                self._say(f"restored from checkpoint epoch {epoch} in {time.monotonic() - t0:.2f}s "
                          f"(restart {self.env.restart_count}){': ' + cost if cost else ''}{note}")
            if failed:     # the restore put back this epoch's output, which ends before the FAILED lines
                self._say(f"epoch {epoch} was restored because newer checkpoints could not be: "
                          + "; ".join(failed))
            return
        if self.env.step == "batch":
            self._say_fresh_start()
        elif plan["candidates"]:
            self._say("no checkpoint could be restored: starting the task from the beginning")
        self._started("run")
        self._launch(relay=False)

    def _say_fresh_start(self) -> None:
        """A requeued job that restored nothing says why, before its first output (Slurm truncated the
        output file at the requeue); the agent composes the line and sets the job's AdminComment to it."""
        try:
            self.fresh_notice = self.call("fresh_start").get("notice")
        except SlurmckptError as e:
            self.fresh_notice = f"starting from the beginning: the reason could not be learnt ({e})"
        if self.fresh_notice:
            self._say(self.fresh_notice)

    def _restore(self, stdio: list[int], epoch: int) -> dict[str, Any]:
        """The batch step also hands over its script (the spool path differs on another node)."""
        script = -1
        if self.env.step == "batch" and self.argv:
            try:
                script = os.open(self.argv[0], os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                script = -1
        pairs = self._standin_sockets(epoch)
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
            assert self.srun_relay is not None
            self.srun_relay.adopt(a)
        return reply

    def _standin_sockets(self, epoch: int) -> list[tuple[socket.socket, socket.socket]]:
        """One new socket pair per srun stand-in in the checkpoint: one end replaces the stand-in's old
        socket (criu --inherit-fd), the other is served here (srun_relay.py)."""
        if self.env.step != "batch" or self.srun_relay is None:   # the agent refuses a checkpoint that
            return []                                               # holds some: none handed in
        count = int(self.call("standins", epoch=epoch).get("count", 0))
        return [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(count)]

    def _shares_cut(self) -> bool:
        """Other ranks restore the same epoch: falling back alone would leave the job at no common cut."""
        return self.member.connected and (self.env.step != "batch" or self.env.tasks > 1)

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
        self._requeue()
