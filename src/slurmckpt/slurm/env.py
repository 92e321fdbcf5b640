"""Every Slurm/slurmckpt environment variable the wrapper reads, in one place (untrusted: user-side only)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from slurmckpt.duration import interval_arg
from slurmckpt.identity import RankName


BATCH_STEP_SIGNED = "-5"


@dataclass(frozen=True)
class TaskEnv:
    job_id: int
    step: str                # "batch" or the step number
    rank: int
    restart_count: int
    interval_s: int          # seconds, 0 off, duration.AUTO
    agent_fd: int | None
    argv0: str | None
    node: str
    tasks: int               # tasks of this step (1 for the batch step)
    argv_form: str | None = None   # SLURMCKPT_TASK_ARGV: "prepended" when Slurm put the wrapper before argv

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> "TaskEnv":
        env = dict(os.environ if env is None else env)
        step = env.get("SLURM_STEP_ID", "batch")
        # The batch step: no SLURM_STEP_ID up to 25.11 (set for ids >= 0 only); 26.05 sets it for every step,
        # printing SLURM_BATCH_SCRIPT (0xfffffffb) with "%d": "-5" ("4294967291" is the same id unsigned).
        if step in ("", BATCH_STEP_SIGNED, "4294967291") or "SLURM_STEP_ID" not in env:
            step = "batch"
        return cls(
            job_id=int(env.get("SLURM_JOB_ID", "0")),
            step=step,
            rank=int(env.get("SLURM_PROCID", "0")),
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            interval_s=interval_arg(env.get("SLURMCKPT_INTERVAL", "0")),
            agent_fd=int(env["SLURMCKPT_AGENT_FD"]) if env.get("SLURMCKPT_AGENT_FD") else None,
            argv0=env.get("SLURMCKPT_TASK_ARGV0"),
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            tasks=1 if step == "batch" else int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1),
            argv_form=env.get("SLURMCKPT_TASK_ARGV"),
        )

    @property
    def rank_name(self) -> str:
        return str(RankName(self.step, self.rank))


# Variables slurmckpt sets for itself; the workload never sees them.
PRIVATE = ("SLURMCKPT_AGENT_FD", "SLURMCKPT_TASK_ARGV0", "SLURMCKPT_TASK_ARGV", "SLURMCKPT_STEP_TOKEN")
