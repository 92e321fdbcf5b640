"""Stand-in for slurmstepd + the SPANK shim, for benchmarks and tests that need the agent/wrapper pair
without a Slurm job: forks the root agent exactly as the shim does (socketpair, child), then becomes the
task (drops to the user) and execs the wrapper. The real path through Slurm is tested in tests/integration.

usage: python -m tests.support.fakestepd --user U --job J [--step S --rank R --restart N --interval S] -- CMD
"""
from __future__ import annotations

import argparse
import os
import pwd
import socket
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--user", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--step", default="batch")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--restart", type=int, default=0)
    ap.add_argument("--interval", type=int, default=0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    pw = pwd.getpwnam(a.user)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.fork() == 0:
        ours.close()
        fd = theirs.detach()
        os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-m", "slurmckpt", "agent", "--fd", str(fd), "--job",
                                  str(a.job), "--step", a.step, "--rank", str(a.rank), "--uid", str(pw.pw_uid),
                                  "--gid", str(pw.pw_gid), "--restart-count", str(a.restart)])
    theirs.close()
    fd = ours.detach()
    os.set_inheritable(fd, True)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    env = dict(os.environ, SLURMCKPT_AGENT_FD=str(fd), SLURM_JOB_ID=str(a.job), SLURM_PROCID=str(a.rank),
               SLURM_RESTART_COUNT=str(a.restart), SLURMCKPT_INTERVAL=str(a.interval), HOME=pw.pw_dir,
               USER=a.user)
    if a.step != "batch":
        env["SLURM_STEP_ID"] = a.step
    os.execve(sys.executable, [sys.executable, "-c", "from slurmckpt.wrapper import main; main()", "--", *cmd],
              env)


if __name__ == "__main__":
    main()
