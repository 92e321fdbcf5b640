"""CRIU driver: the only module that builds criu command lines."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from slurmckpt.errors import CriuError, CriuInterrupted

MIN_VERSION = (4, 1)
# criu past its timeout is stopped the way its own source allows (CRIU 4.2.1): it handles neither SIGTERM nor
# SIGINT (their default action ends it at once, as SIGKILL does, with its parasite still in the tree and its
# network lock held), but its dump installs a SIGALRM handler for its own --timeout (cr-dump.c
# alarm_handler): the system call it is blocked in fails with EINTR and the dump leaves through its error
# path, which cures the parasite, releases the tasks and takes back its network lock, link remaps and
# mounts. The handler re-arms itself every second and gives up (BUG) after 5 more. So: SIGALRM, up to
# STOP_GRACE_S to exit, then SIGKILL. Either way the caller trusts nothing criu left (CriuInterrupted).
STOP_SIGNAL = signal.SIGALRM
STOP_GRACE_S = 10.0

# Options every dump and restore shares. --tcp-established: loopback/peer TCP inside the tree is restored;
# --ext-unix-sk: sockets to daemons outside (syslog, nscd); --file-locks;
# --manage-cgroups=ignore: the tree lives in our freezer cgroup, which the agent manages itself.
COMMON = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--manage-cgroups=ignore"]
# A tree with its own mount namespace (a GPU task: launch.py): every mount of its slave copy of the node's
# is the node's own, so external (criu cannot dump the driver's or the image store's mounts); the restore
# builds the namespace again on the node's root (without --root, criu 4.2 stops at "mnt: BUG").
MNTNS_DUMP = ["--ext-mount-map", "auto", "--enable-external-sharing", "--enable-external-masters"]
MNTNS_RESTORE = [*MNTNS_DUMP, "--root", "/"]


@dataclass(frozen=True)
class InheritedFd:
    """A resource the restored tree keeps using from outside (stdio pipe to srun, the output file)."""
    key: str        # criu's id: pipe:[123], socket:[45], file[MNT:INO] or a path without the leading '/'
    fd: int         # the fd, in the process that runs criu, that stands in for it


class CheckpointEngine(Protocol):
    def dump(self, pid: int, images: Path, *, leave_running: bool, freezer: Path | None,
             ghost_limit: int = 0, external: list[str] | None = None, link_remap: bool = False,
             mntns: bool = False, inherited_devices: Sequence[int] = (), leave_stopped: bool = False,
             skip_pages: Sequence[tuple[int, int, int]] = ()) -> float: ...
    def restore(self, images: Path, inherit: list[InheritedFd], *, freezer: Path | None,
                pidfile: Path | None = None, join: Callable[[int], None] | None = None,
                tcp_close: Sequence[int] = (), mntns: bool = False, leave_stopped: bool = False) -> int: ...


@dataclass
class CriuDriver:
    binary: str = "criu"
    extra_args: tuple[str, ...] = ()
    timeout_s: float = 600.0
    stop_grace_s: float = STOP_GRACE_S
    env: dict[str, str] = field(default_factory=lambda: {"PATH": "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"})
    network_lock: str = "iptables"      # or nftables: criu's lock of the tree's TCP (packet_filter.method)

    def version(self) -> tuple[int, ...]:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, env=self.env).stdout
        m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not m:
            raise CriuError(f"cannot read criu version from {out!r}", binary=self.binary)
        return tuple(int(x) for x in m.groups() if x is not None)

    def check(self) -> tuple[bool, str]:
        p = subprocess.run([self.binary, "check"], capture_output=True, text=True, env=self.env)
        return p.returncode == 0, (p.stdout + p.stderr).strip()

    def dump(self, pid: int, images: Path, *, leave_running: bool, freezer: Path | None,
             ghost_limit: int = 0, external: list[str] | None = None, link_remap: bool = False,
             mntns: bool = False, inherited_devices: Sequence[int] = (), leave_stopped: bool = False,
             skip_pages: Sequence[tuple[int, int, int]] = ()) -> float:
        """Dump the tree rooted at `pid` (a PID-namespace init). Returns seconds spent in criu.
        `ghost_limit`: bytes of the biggest deleted file criu may copy into the images (0: criu's default;
        ghost.py sizes it from the tree). `external`: criu `--external` resources, e.g. `unix[INO]` for a
        socket whose peer stays outside (the PMI socket, pmi.py), handed in again at the restore. `link_remap`:
        files held by a removed name that has another name (sem_open's) are linked to link_remap.N for the
        dump (shm_files.py puts those links back before the restore). `mntns`: the tree has its own mount
        namespace (MNTNS_DUMP). `inherited_devices`: character device majors whose mappings and fds the tree
        still holds though it uses no device (children forked from a CUDA process): kept as reservations
        (our criu patch 0004, cuda/procscan.inherited_device_majors). `leave_stopped`: the tree stays
        stopped (SIGSTOP) after the dump, for a GPU restore with only the driver's threads running (a failed
        dump leaves it as it was). `skip_pages`: (pid, start, end) ranges whose pages the caller copied
        itself, dumped as untouched (our criu patch 0008; rank/host_copy.py)."""
        args = ["dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v2", *COMMON,
                *(MNTNS_DUMP if mntns else [])]
        for res in external or []:
            args += ["--external", res]
        if ghost_limit:
            args += ["--ghost-limit", str(ghost_limit)]
        if link_remap:
            args.append("--link-remap")
        for major in inherited_devices:
            args += ["--inherited-device-major", str(int(major))]
        for spid, start, end in skip_pages:      # copied by slurmckpt itself (our criu patch 0008, host_copy.py)
            args += ["--skip-pages", f"{int(spid)}:{int(start):x}-{int(end):x}"]
        if leave_stopped:
            args.append("--leave-stopped")
        elif leave_running:
            args.append("--leave-running")
        if freezer is not None:
            args += ["--freeze-cgroup", str(freezer)]
        return self._run(args, images, "dump.log", pid=pid)

    def restore(self, images: Path, inherit: list[InheritedFd], *, freezer: Path | None,
                pidfile: Path | None = None, join: Callable[[int], None] | None = None,
                tcp_close: Sequence[int] = (), mntns: bool = False, leave_stopped: bool = False) -> int:
        """Restore detached; the restored root re-parents to the nearest subreaper (the task's wrapper).
        `join(pid)` places the criu process (whose cgroups the restored tree inherits); by default it joins
        `freezer`. `tcp_close`: socket inodes (at dump) of TCP connections restored closed (our criu patch
        0003: their other end is outside the job). `leave_stopped`: the restored tree stays stopped (its GPU
        state is restored before it runs). Returns the restored root's host PID."""
        pidfile = pidfile or images / "restore.pid"
        pidfile.unlink(missing_ok=True)        # criu refuses an existing pidfile
        args = ["restore", "-D", str(images), "-o", "restore.log", "-v2", "-d", "--pidfile", str(pidfile),
                *COMMON, *(MNTNS_RESTORE if mntns else [])]
        for item in inherit:
            args += ["--inherit-fd", f"fd[{item.fd}]:{item.key}"]
        for ino in tcp_close:
            args += ["--tcp-close-ino", str(int(ino))]
        if leave_stopped:
            args.append("--leave-stopped")

        def join_freezer() -> None:   # runs in the criu child: the restored tree inherits the cgroup
            _default_signals()
            if join is not None:
                join(os.getpid())
            elif freezer is not None:
                (freezer / "cgroup.procs").write_text(str(os.getpid()))

        self._run(args, images, "restore.log", pass_fds=[i.fd for i in inherit], preexec=join_freezer)
        return int(pidfile.read_text().strip())

    def _run(self, args: list[str], images: Path, log: str, pid: int | None = None,
             pass_fds: list[int] | None = None, preexec: Callable[[], None] | None = None) -> float:
        cmd = [self.binary, *args, "--network-lock", self.network_lock, *self.extra_args]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                pass_fds=pass_fds or [], preexec_fn=preexec or _default_signals)
        try:
            _, stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            how = _stop(proc, self.stop_grace_s)
            raise CriuInterrupted(f"criu {args[0]} did not finish within {self.timeout_s:g}s; {how}",
                                  _tail(images / log), pid=pid, images=str(images)) from None
        except BaseException:
            _stop(proc, self.stop_grace_s)        # never leave criu running on behind its caller
            raise
        if proc.returncode < 0:
            raise CriuInterrupted(f"criu {args[0]} was killed by signal {-proc.returncode}",
                                  _tail(images / log) or stderr[-2000:], pid=pid, images=str(images))
        if proc.returncode != 0:
            raise CriuError(f"criu {args[0]} failed with exit code {proc.returncode}",
                            _tail(images / log) or stderr[-2000:], pid=pid, images=str(images))
        return time.monotonic() - start


def _stop(proc: subprocess.Popen[str], grace_s: float) -> str:
    """STOP_SIGNAL, then SIGKILL if criu has not exited within `grace_s`; says which ended it."""
    proc.send_signal(STOP_SIGNAL)
    try:
        proc.communicate(timeout=grace_s)
        return f"stopped with {STOP_SIGNAL.name}, it exited ({proc.returncode})"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"it did not exit within {grace_s:g}s of {STOP_SIGNAL.name} and was killed"


def _default_signals() -> None:
    """criu must not inherit the agent's ignored signals: a restore then hangs after the tasks resumed, and
    an ignored STOP_SIGNAL would not stop it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, STOP_SIGNAL):
        signal.signal(sig, signal.SIG_DFL)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
