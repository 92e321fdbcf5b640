"""The `srun` an MPI launcher in a batch step finds first in PATH (docs/mpi.md, "mpirun starting orted").

OpenMPI's mpirun starts its daemons on the job's other nodes with `srun ... orted`. A real srun holds
connections to slurmctld and slurmstepd that no restore can bring back, so a batch step running one could
only be replayed (its script run again from the top) while the daemons it started are restored: mpirun and
its orted would no longer match. This stand-in is what mpirun runs instead. It stays in the tree, a small
process that criu images with mpirun, and has the task's wrapper (outside the tree) run the real srun with
the stand-in's own argv, environment, directory and stdio:

    stand-in -> wrapper   {"argv", "env", "cwd", "token"?} + fds [stdin, stdout, stderr, this socket]
    wrapper  -> stand-in  {"token": T}        the step's name for its checkpoints (kept for a resend)
                          {"exit": N} / {"signal": S}   the real srun ended so: the stand-in does the same
                          {"resend": true}    after a restore: a new wrapper needs the request again
    stand-in -> wrapper   {"signal": S}       a signal mpirun sent to its srun (passed on to the real one)

The socket to the wrapper is dumped as an external resource and, at the restore, replaced by one whose other
end is the new wrapper (criu --inherit-fd), which asks for a resend and runs the real srun again: its step
restores the images of the old one by the token (agent.py, `plan`). An srun not started by an MPI launcher
(or started where no wrapper serves) is the real one at once (exec), as without slurmckpt.

What is installed as `srun` (`install`) is a small shell script: it starts this module only under an MPI
launcher and execs the real srun otherwise, so that a batch script's own sruns do not pay for starting
Python (about 70 ms each on the test VM).
"""
from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys
from typing import Any

from slurmckpt.node import procfs
from slurmckpt.channel import Channel

RELAY = "SLURMCKPT_SRUN_RELAY"           # the socket path the wrapper serves (the tree's env only)
REAL_SRUN = "SLURMCKPT_REAL_SRUN"        # the real srun's path, found by the wrapper in the task's PATH
# Launchers whose srun starts daemons that talk back to them (OpenMPI's mpirun/orterun/prterun, MPICH's
# hydra with its slurm bootstrap)
LAUNCHERS = ("orterun", "mpirun", "mpiexec", "prterun", "prte", "mpiexec.hydra", "mpiexec.openmpi",
             "mpirun.openmpi", "mpiexec.mpich", "mpirun.mpich")
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)


def launched_by_mpi() -> bool:
    """The parent is an MPI launcher. Its pid is read from /proc/self: a CPU task's tree has its own PID
    namespace but the node's /proc, so getppid() would name another process there."""
    try:
        ppid = int(procfs.status("self")["PPid"][0])
        return os.path.basename(procfs.exe(ppid)) in LAUNCHERS
    except (OSError, KeyError, IndexError, ValueError):
        return False


def exec_real(argv: list[str], environ: dict[str, str]) -> None:
    real = environ.get(REAL_SRUN, "")
    env = {k: v for k, v in environ.items() if k not in (RELAY, REAL_SRUN)}
    if not (real and os.path.isabs(real) and os.access(real, os.X_OK)):
        sys.exit(f"srun (slurmckpt stand-in): the real srun is not known ({REAL_SRUN} is unset)")
    os.execve(real, [real, *argv[1:]], env)


def connect(path: str) -> socket.socket:
    """The wrapper's socket (a path in a directory only the job's user enters, srun_relay.py), checked to
    be served by the job's own user."""
    if not path.startswith("/"):
        raise ConnectionRefusedError(f"the relay is no socket path: {path!r}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():
        s.close()
        raise ConnectionRefusedError(f"the relay is served by uid {uid}, not ours")
    return s


def serve(chan: Channel, request: dict[str, Any]) -> int:
    """Send the request, then follow the wrapper until the real srun ended; returns the exit code (a signal
    it died of is raised on ourselves, so mpirun sees the same end)."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    for sig in PASSED_ON:
        signal.signal(sig, lambda s, f: None)
    chan.send(request, [0, 1, 2, chan.sock.fileno()])
    while True:
        ready, _, _ = select.select([chan.sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            for number in os.read(wake_r, 512):
                chan.send({"signal": number})
        if chan.sock.fileno() not in ready:
            continue
        try:
            message, fds = chan.recv()
        except EOFError:
            return 255           # the wrapper is gone: the step is ending
        for fd in fds:
            os.close(fd)
        if "token" in message:
            request["token"] = str(message["token"])
        elif message.get("resend"):
            chan.send(request, [0, 1, 2, chan.sock.fileno()])
        elif "signal" in message:
            signal.signal(int(message["signal"]), signal.SIG_DFL)
            os.kill(os.getpid(), int(message["signal"]))
            return 128 + int(message["signal"])
        elif "exit" in message:
            return int(message["exit"])


SCRIPT = """#!/bin/sh
# slurmckpt's srun stand-in (written by slurmckpt.task.srun_standin.install; docs/mpi.md): an MPI launcher's srun
# goes to the batch wrapper's relay; any other caller gets the real srun at once. The parent's pid is read
# from /proc/self, which is the shell's own here: the tree has its own PID namespace but the node's /proc.
ppid=
while read -r key value _; do
    if [ "$key" = "PPid:" ]; then ppid=$value; break; fi
done < /proc/self/status
case "$(readlink "/proc/$ppid/exe" 2>/dev/null)" in
    {patterns}) exec {python} -m slurmckpt.task.srun_standin "$@" ;;
esac
if [ -z "${{{real}:-}}" ]; then
    echo "srun (slurmckpt stand-in): the real srun is not known ({real} is unset)" >&2
    exit 1
fi
real=${{{real}}}
unset {real} {relay}
exec "$real" "$@"
"""


def install(directory: str, python: str) -> str:
    """Write the `srun` stand-in script into `directory` for `python` (an absolute path); returns its path."""
    if not os.path.isabs(python) or any(c in python for c in " \t\n'\"$`\\"):
        raise ValueError(f"python must be an absolute path without shell specials: {python!r}")
    from slurmckpt.slurm.control import SRUN     # the tool's name, where Slurm's tools are named
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = os.path.join(directory, SRUN)
    text = SCRIPT.format(patterns="|".join(f"*/{name}" for name in LAUNCHERS), python=python, real=REAL_SRUN,
                         relay=RELAY)
    tmp = path + ".new"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    environ = dict(os.environ)
    name = environ.get(RELAY)
    if not name or not launched_by_mpi():
        exec_real(argv, environ)
        return
    try:
        sock = connect(name)
    except OSError:
        exec_real(argv, environ)         # no wrapper serves (a nested job, a stale environment)
    request = {"argv": argv, "env": {k: v for k, v in environ.items() if k not in (RELAY, REAL_SRUN)},
               "cwd": os.getcwd()}
    sys.exit(serve(Channel(sock), request))


if __name__ == "__main__":
    main()
