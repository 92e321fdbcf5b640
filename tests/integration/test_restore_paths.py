"""Restore never lets root CRIU follow a user's path (docs/security.md, "Restore: identities and paths").

Each test is an attack by the job's user between a committed capture and the restore: the job is captured
by `scontrol requeuehold` and held, the user swaps a path its workload had (tests/integration/workloads/
pathhold.py) for a symlink to root's file or directory, and the job is released. Stock `criu restore` runs as
root, re-resolves the path and checks only size and mode, which the swap keeps equal (asserted), so it would
give the restored process root's file. Our CRIU (scripts/criu-patches/0002-restore-as-the-task.patch)
resolves it as the task's user: the restore fails, slurmckpt says so in the job's output and starts the task
from the beginning, and nothing of root's was opened, written or created."""
from __future__ import annotations

import hashlib
import os
import re
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from tests.integration.slurmjob import Job, node, release_expect_fallback, run, submit, workdir

USER = "ckptuser1"
ROOT_DIR = Path("/var/lib/slurmckpt-test")      # root's side of each attack
CRIU = "/usr/local/sbin/criu"
# One node: a batch job restored on another node fails anyway (bash holds slurmd's spool copy of the
# script, which exists only on the node that ran it), which would hide what these tests look at.
NODE = "node3"                     # (slurmjob.node: node1 on a one-node cluster)


def root_path(name: str, mode: int, size: int | None = None) -> Path:
    """A fresh root-owned file of `size` random bytes, or directory when size is None, with `mode`."""
    ROOT_DIR.mkdir(mode=0o755, exist_ok=True)
    path = ROOT_DIR / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if size is None:
        path.mkdir()
    else:
        path.write_bytes(os.urandom(size))
    os.chown(path, 0, 0)
    path.chmod(mode)
    return path


def user_file(path: Path, size: int, mode: int) -> None:
    pw = pwd.getpwnam(USER)
    path.write_bytes(b"\0" * size)
    os.chown(path, pw.pw_uid, pw.pw_gid)
    path.chmod(mode)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def holders(target: Path) -> list[str]:
    """Processes that hold `target` (or something under it) as an fd, a mapping or their cwd."""
    t, found = str(target), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/cwd")]
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                links += [line.split(None, 5)[-1].strip() for line in f]
        except OSError:
            continue
        found += [f"{pid}: {link}" for link in links if link == t or link.startswith(t + "/")]
    return found


def start_held(wd: Path, mode: str, path: str) -> Job:
    """A job running pathhold.py in `wd`, captured by a requeue and held (PENDING): the user's window."""
    job = submit(USER, wd, f"#!/bin/bash\npython3 pathhold.py --mode {mode} --path {path} --state state\n",
                 "-w", node(NODE), "--checkpoint-interval=30m")
    job.wait_output(r"pathhold step 3 |Error", timeout=90)
    assert "pathhold step 3 " in job.text(), job.text()[-2000:]
    run("scontrol", "requeuehold", str(job.id))      # final capture, then held
    job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
    job.wait_output(r"(?:committed|captured) \(sigterm\)", timeout=30)
    return job


def as_user(script: str, cwd: Path) -> None:
    run("sh", "-euc", script, user=USER, cwd=cwd)


def finish(job: Job, root_thing: Path) -> None:
    """After the failed restore: nothing holds root's file or directory, the fresh start ran to the end."""
    assert holders(root_thing) == [], f"a process holds root's {root_thing}"
    job.wait_output(r"pathhold fresh start", timeout=60)
    assert job.wait_done(timeout=60) == "COMPLETED"
    text = job.text()
    assert re.search(r"starting from the beginning \(restart 1\): restore of checkpoint epoch \d+ failed", text), \
        text[-3000:]
    assert str(root_thing) not in "\n".join(job.app_lines()), "the workload saw root's path"


def same_size_and_mode(user_stat: os.stat_result, swapped: Path) -> None:
    """The precondition that makes the swap work against stock CRIU: its own check (size, mode) passes."""
    st = swapped.stat()        # follows the user's symlink, as root CRIU does
    assert (st.st_mode, st.st_size if stat.S_ISREG(st.st_mode) else 0) == \
        (user_stat.st_mode, user_stat.st_size if stat.S_ISREG(user_stat.st_mode) else 0)
    assert st.st_uid == 0 and swapped.is_symlink()


def cancel(job: Job) -> None:
    run("scancel", str(job.id), check=False)


# ---- 1. a file open O_RDWR ---------------------------------------------------------------------------
def test_open_rdwr_file_swapped_for_root_file_is_not_reopened() -> None:
    """The workload holds data.bin O_RDWR; the user replaces it with a symlink to a root 0644 file of the
    same size. slurmckpt's own truncate step (opened as the user) already refuses this one before CRIU runs,
    so the second half repeats the attack on CRIU directly, which needs the patch."""
    wd = workdir(USER, "restore-path-rdwr")
    user_file(wd / "data.bin", 4096, 0o644)
    secret = root_path("secret-rdwr", 0o644, 4096)
    before, recorded = digest(secret), (wd / "data.bin").stat()
    job = start_held(wd, "rdwr", "data.bin")
    try:
        as_user(f"rm data.bin; ln -s {secret} data.bin", wd)
        same_size_and_mode(recorded, wd / "data.bin")
        release_expect_fallback(job, r"cannot prepare files for restore: cannot open \S*/data.bin as the "
                                     r"job's user: Permission denied")
        finish(job, secret)
        assert digest(secret) == before, "root's file was written"
    finally:
        cancel(job)
    criu_direct_rdwr_attack()


def criu_direct_rdwr_attack() -> None:
    """The same swap against `criu dump`/`criu restore` run by hand (as the agent does, root): the restore
    fails with CRIU's "Can't open file" and the root file is neither held nor written."""
    wd = workdir(USER, "restore-path-direct")
    pw = pwd.getpwnam(USER)
    user_file(wd / "data.bin", 4096, 0o644)
    secret = root_path("secret-direct", 0o644, 4096)
    images = root_path("images-direct", 0o700)
    before, recorded = digest(secret), (wd / "data.bin").stat()
    out = wd / "out"
    user_file(out, 0, 0o644)

    def demote() -> None:
        os.setsid()
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    with open(out, "w") as f:
        proc = subprocess.Popen(["/usr/bin/python3", str(wd / "pathhold.py"), "--mode", "rdwr", "--path",
                                 str(wd / "data.bin"), "--state", str(wd / "state"), "--sleep", "0.1"],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, cwd=wd,
                                env={"PATH": "/usr/bin:/bin"}, preexec_fn=demote)
    restored = None
    try:
        deadline = time.monotonic() + 30
        while "pathhold step 2 " not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"pathhold: {out.read_text()}"
            time.sleep(0.1)
        run(CRIU, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log")
        proc.wait(timeout=10)
        as_user(f"rm data.bin; ln -s {secret} data.bin", wd)
        same_size_and_mode(recorded, wd / "data.bin")
        p = run(CRIU, "restore", "-D", str(images), "-o", "restore.log", "-d", "--pidfile",
                str(images / "pid"), check=False)
        if p.returncode == 0:
            restored = int((images / "pid").read_text())
        log = (images / "restore.log").read_text(errors="replace")
        assert p.returncode != 0, f"criu restored the tree onto root's file (pid {restored})"
        assert "Can't open file" in log and "Permission denied" in log, log[-2000:]
        assert holders(secret) == []
        assert digest(secret) == before, "root's file was written"
    finally:
        for pid in (proc.pid, restored):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.poll()


# ---- 2. a file mapped shared and writable --------------------------------------------------------------
def test_shared_mapping_swapped_for_root_file_is_not_remapped() -> None:
    wd = workdir(USER, "restore-path-mmap")
    user_file(wd / "map.bin", 4096, 0o644)
    secret = root_path("secret-mmap", 0o644, 4096)
    before, recorded = digest(secret), (wd / "map.bin").stat()
    job = start_held(wd, "mmap", "map.bin")
    try:
        assert f"holds {wd / 'map.bin'}" in job.text(), "the workload did not map the file"
        as_user(f"rm map.bin; ln -s {secret} map.bin", wd)
        same_size_and_mode(recorded, wd / "map.bin")
        release_expect_fallback(job, r"Can't open file \S*/map.bin: Permission denied")
        finish(job, secret)
        assert digest(secret) == before, "root's file was written through the mapping"
    finally:
        cancel(job)


# ---- 3. the working directory --------------------------------------------------------------------------
def test_cwd_swapped_for_root_only_directory_is_not_entered() -> None:
    wd = workdir(USER, "restore-path-cwd")
    (wd / "cwd").mkdir(mode=0o700)
    pw = pwd.getpwnam(USER)
    os.chown(wd / "cwd", pw.pw_uid, pw.pw_gid)
    rootonly = root_path("rootonly", 0o700)
    recorded = (wd / "cwd").stat()
    job = start_held(wd, "cwd", "cwd")
    try:
        assert f"holds {wd / 'cwd'}" in job.text()
        as_user(f"mv cwd cwd.orig; ln -s {rootonly} cwd", wd)
        same_size_and_mode(recorded, wd / "cwd")
        assert run("test", "-r", str(wd / "cwd"), user=USER, check=False).returncode != 0
        release_expect_fallback(job, r"Can't open file \S*/cwd: Permission denied")
        finish(job, rootonly)
    finally:
        cancel(job)


# ---- 4. a bound unix socket ----------------------------------------------------------------------------
def test_unix_socket_dir_swapped_for_root_directory_gets_no_socket() -> None:
    wd = workdir(USER, "restore-path-unix")
    pw = pwd.getpwnam(USER)
    (wd / "sockdir").mkdir(mode=0o755)
    os.chown(wd / "sockdir", pw.pw_uid, pw.pw_gid)
    rootdir = root_path("rootdir", 0o755)
    job = start_held(wd, "unix", "sockdir/sock")
    try:
        assert "holds sockdir/sock" in job.text(), "the workload did not bind its socket"
        as_user(f"mv sockdir sockdir.orig; ln -s {rootdir} sockdir", wd)
        # root CRIU would chdir through the link and bind there; the user cannot write the directory
        assert (wd / "sockdir").resolve() == rootdir
        assert run("test", "-w", str(rootdir), user=USER, check=False).returncode != 0
        release_expect_fallback(job, r"Can't bind .*sockdir/sock: Permission denied")
        assert list(rootdir.iterdir()) == [], f"the restore created {list(rootdir.iterdir())}"
        finish(job, rootdir)
        assert list(rootdir.iterdir()) == []
    finally:
        cancel(job)
