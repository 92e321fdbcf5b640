"""A restore never lends root's identity to what it makes for the job (docs/security.md, "Restore: identities
and paths").

`criu restore` runs as root and makes every object of the restored tree before the tasks take their own
credentials; the kernel records whoever makes it. Stock CRIU (and ours before
scripts/criu-patches/0002-restore-as-the-task.patch) so handed the job's processes unix sockets that showed
uid 0 to every peer, a backlog connection made again by connect() as root (redirected by the user between
bind and connect, a root service saw uid 0), inotify watches added as root by a path the user can swap, and
mounts placed by root through the user's directories. Each test is that attack by the job's user against
the real cluster, failing when it works."""
from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

from tests.integration.slurmjob import RESTORE_OUTCOME, Job, node, release_expect_fallback, run, submit, workdir, PGREP_HERE

USER, OTHER = "ckptuser1", "ckptuser2"
ROOT_DIR = Path("/var/lib/slurmckpt-test")
NODE = "node2"
NODE_GPU = "node1"          # a task with a GPU gets its own mount namespace (gres.conf: fake GPUs)
PEERCRED = ("import socket, struct, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "print(*struct.unpack('3i', s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1:])")


def parent_pid(pid: str) -> str:
    """`pid`'s parent, or "" once it has gone (a slurmd child may end between pgrep and here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except FileNotFoundError:
        return ""


def node_slurmd_pid(node_name: str) -> str:
    """The slurmd of `node_name`: its mount namespace is the node's (scripts/cluster.sh)."""
    pids = run(*PGREP_HERE, "-x", "-f", f"slurmd -N {node_name}").stdout.split()
    # slurmd forks briefly (to start a slurmstepd, to run a prolog): a child has the same command line
    daemons = [p for p in pids if parent_pid(p) not in pids + [""]]
    assert len(daemons) == 1, f"slurmd of {node_name}: {pids}"
    return daemons[0]


def listener_identity(path: Path) -> tuple[int, int]:
    """The uid and gid another user's client sees for the job's listening socket."""
    out = run("/usr/bin/python3", "-c", PEERCRED, str(path), user=OTHER).stdout.split()
    return int(out[0]), int(out[1])


def held_then_released(job: Job, ready: str) -> None:
    """Capture the job by a requeue and hold it (the user's window), then leave it held."""
    job.wait_output(ready, timeout=90)
    run("scontrol", "requeuehold", str(job.id))
    job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
    job.wait_output(r"(?:committed|captured) \(sigterm\)", timeout=30)


def root_dir(name: str, mode: int) -> Path:
    ROOT_DIR.mkdir(mode=0o755, exist_ok=True)
    path = ROOT_DIR / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    path.chmod(mode)
    return path


# ---- sockets: SO_PEERCRED and the socket's owner --------------------------------------------------------
def test_restored_unix_sockets_carry_the_job_users_identity_not_roots() -> None:
    """Before the capture another user's client sees the job's uid on its listening socket; after the
    restore it must see the same (stock CRIU: uid 0, a socket that root services would believe is root's),
    and so must the backlog connection criu makes again with connect(), the socketpair and the sockets'
    owner."""
    pw = pwd.getpwnam(USER)
    wd = workdir(USER, "identity-sockets")
    job = submit(USER, wd, "#!/bin/bash\npython3 peercred.py\n", "-w", node(NODE), "--checkpoint-interval=30m")
    try:
        job.wait_output(r"peercred step 2\b", timeout=90)
        assert listener_identity(wd / "listen.sock") == (pw.pw_uid, pw.pw_gid)
        # the probe accepted and closed by the workload (criu refuses a closed connection in a backlog)
        job.wait_output(r"peercred step \d+\n", count=len(re.findall(r"peercred step", job.text())) + 2,
                        timeout=30)
        job.requeue()
        job.wait_output(RESTORE_OUTCOME, timeout=180)
        assert "restored from checkpoint epoch" in job.text(), job.text()[-3000:]
        seen = listener_identity(wd / "listen.sock")
        assert seen == (pw.pw_uid, pw.pw_gid), f"another user's client sees uid/gid {seen} on the restored " \
                                               f"listener (the job's are {pw.pw_uid}/{pw.pw_gid})"
        run("touch", "report", user=USER, cwd=wd)
        job.wait_output(r"peercred socket-owner uid=\d+", timeout=30)
        rows = dict(re.findall(r"peercred (\S+) uid=(\d+)", job.text()))
        assert rows == {"backlog-server": str(pw.pw_uid), "backlog-client": str(pw.pw_uid),
                        "socketpair": str(pw.pw_uid), "socket-owner": str(pw.pw_uid)}, rows
        assert not re.search(r"peercred \S+ uid=\d+ gid=0\b", job.text()), job.text()[-2000:]
    finally:
        run("scancel", str(job.id), check=False)


# ---- inotify: a watch re-added by the image's path -----------------------------------------------------
def test_inotify_watch_swapped_for_root_directory_reports_nothing_of_roots() -> None:
    """The job watches a directory of its own; while it is held the user swaps it for a symlink to a root-only
    directory. Stock CRIU re-adds the watch as root through the link and the restored process is told the
    names of files created in root's directory; ours looks the watch up as the user, sees another inode and
    fails the restore, which falls back to a fresh start."""
    wd = workdir(USER, "identity-inotify")
    (wd / "watched").mkdir()
    os.chown(wd / "watched", pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid)
    secret = root_dir("inotify-secret", 0o700)
    job = submit(USER, wd, "#!/bin/bash\npython3 pathhold.py --mode inotify --path watched --state state\n",
                 "-w", node(NODE), "--checkpoint-interval=30m")
    try:
        held_then_released(job, r"pathhold step 3 ")
        run("sh", "-euc", f"mv watched watched.orig; ln -s {secret} watched", user=USER, cwd=wd)
        # the precondition: root would follow the link, the user cannot read what it points to
        assert (wd / "watched").resolve() == secret
        assert run("ls", str(secret), user=USER, check=False).returncode != 0
        text = release_expect_fallback(job, r"is another file now")
        (secret / "root-secret-name").write_text("x")
        job.wait_output(r"pathhold fresh start", timeout=60)
        assert "root-secret-name" not in job.text(), text[-2000:]
    finally:
        run("scancel", str(job.id), check=False)


# ---- mounts of a restored mount namespace --------------------------------------------------------------
def test_mount_under_the_users_directory_is_not_placed_through_a_symlink() -> None:
    """A GPU task (its own mount namespace, a slave copy of the node's) holds a mount that sits in the user's
    directory (here root's tmpfs, as an automount or a FUSE mount would). While the job is held the user
    replaces the directory above the mount point by a symlink to a root directory; root CRIU would bind the
    mount from, and place it at, whatever the link names in the restored namespace (over /etc, say, which a
    set-uid program then reads). Ours opens mount points without following symlinks: the restore fails and
    falls back."""
    uid, gid = pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid
    wd = workdir(USER, "identity-mount")
    for d in (wd / "mp", wd / "mp" / "m"):
        d.mkdir()
        os.chown(d, uid, gid)
    target = root_dir("mount-target", 0o755)
    (target / "m").mkdir()
    # in the node's mount namespace (cluster.sh: slurmd's own), which the task's namespace copies
    ns = ["nsenter", "--mount", "--target", node_slurmd_pid(NODE_GPU)]
    run(*ns, "mount", "-t", "tmpfs", "-o", "size=1m", "slurmckpt-test", str(wd / "mp" / "m"))
    job = None
    try:
        job = submit(USER, wd, "#!/bin/bash\npython3 pathhold.py --mode cwd --path . --state state\n",
                     "--gres=gpu:1", "-w", NODE_GPU, "--checkpoint-interval=30m")
        held_then_released(job, r"pathhold step 3 ")
        # relative: criu resolves it inside the namespace it assembles, where it leads to root's directory
        run("sh", "-euc", f"mv mp mp.orig; ln -s {os.path.relpath(target, wd)} mp", user=USER, cwd=wd)
        assert (wd / "mp" / "m").resolve() == target / "m"
        release_expect_fallback(job, r"without following symlinks")
        job.wait_output(r"pathhold fresh start", timeout=60)
        for pid in ("self", node_slurmd_pid(NODE_GPU)):
            mounted = Path(f"/proc/{pid}/mountinfo").read_text()
            assert f" {target}/m " not in mounted, f"a mount was placed on root's directory (/proc/{pid}/mountinfo)"
    finally:
        if job is not None:
            run("scancel", str(job.id), check=False)
        for p in (wd / "mp.orig" / "m", wd / "mp" / "m"):
            subprocess.run([*ns, "umount", "-l", str(p)], capture_output=True)
