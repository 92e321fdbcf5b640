"""Attacks on the launch and capture side of the root agent, each run as an unprivileged job user against
the real cluster and agent: loader variables through sbatch --export, a working directory the user cannot
enter, the namespace init's directory, the freeze control, and an output fd the user cannot read."""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import uuid
from pathlib import Path

from slurmckpt import asuser
from slurmckpt.errors import PermissionDenied
from slurmckpt.launch import Credentials
from tests.integration.slurmjob import run, submit, task_cgroups, workdir
from tests.integration.test_security import _agent_and_attacker

USER = "ckptuser1"
PRELOAD_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char line[256] = "", cap[64] = "?";
    FILE *s = fopen("/proc/self/status", "r"), *log = fopen(LOGFILE, "a");
    while (s && fgets(line, sizeof line, s))
        if (!strncmp(line, "CapEff:", 7)) sscanf(line + 7, "%63s", cap);
    if (log) fprintf(log, "pid=%d euid=%d capeff=%s\n", getpid(), geteuid(), cap);
    if (log) fclose(log);
    if (s) fclose(s);
}
"""


def _tree_pids(job_id: int) -> list[int]:
    return [pid for cg in task_cgroups(job_id) for pid in cg.pids()]


def _ns_init(job_id: int) -> int:
    for pid in _tree_pids(job_id):
        nspid = next(l for l in open(f"/proc/{pid}/status") if l.startswith("NSpid:")).split()[1:]
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
    raise AssertionError(f"job {job_id}: no PID-namespace init in its trees {_tree_pids(job_id)}")


def _build_preload(wd: Path, log: Path) -> Path:
    src, lib = wd / "mark.c", wd / "mark.so"
    src.write_text(PRELOAD_C)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DLOGFILE="{log}"', "-o", str(lib), str(src)], check=True)
    os.chmod(lib, 0o755)
    return lib


def test_loader_variables_from_sbatch_export_never_reach_a_privileged_process() -> None:
    """LD_PRELOAD, LD_LIBRARY_PATH and GCONV_PATH exported by the user reach the workload (it runs as the
    user, without capabilities) and nothing that runs as root or with capabilities: every process that
    loaded the library logs a non-zero euid and an empty effective capability set, and the namespace init's
    environment holds none of them. The same library given to setpriv as root runs as uid 0 (the attack)."""
    wd = workdir(USER, "preload")
    log = Path(f"/var/tmp/slurmckpt-preload-{uuid.uuid4().hex}.log")
    log.touch()
    log.chmod(0o666)
    lib = _build_preload(wd, log)
    subprocess.run(["env", f"LD_PRELOAD={lib}", "/usr/bin/setpriv", "--reuid=65534", "true"], check=True)
    assert re.search(r"euid=0 ", log.read_text()), "the attack's premise: setpriv as root loads LD_PRELOAD"
    log.write_text("")
    job = submit(USER, wd, "#!/bin/bash\npython3 -c 'import time\nfor i in range(600): time.sleep(0.1)'\n",
                 "--checkpoint-interval=10s",
                 f"--export=ALL,LD_PRELOAD={lib},LD_LIBRARY_PATH={wd},GCONV_PATH={wd}")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        init = _ns_init(job.id)
        init_env = open(f"/proc/{init}/environ", "rb").read().split(b"\0")
        assert not [e for e in init_env if e.startswith((b"LD_", b"GCONV"))], init_env
        workload = [p for p in _tree_pids(job.id) if p != init]
        assert any(b"LD_PRELOAD=" + str(lib).encode() in open(f"/proc/{p}/environ", "rb").read()
                   for p in workload), "the user's environment must still reach the workload"
        lines = log.read_text().splitlines()
        assert lines, "the workload loaded the user's library"
        bad = [l for l in lines if " euid=0 " in l or not l.endswith("capeff=0000000000000000")]
        assert not bad, f"the user's library ran privileged: {bad}"
    finally:
        run("scancel", str(job.id))
        log.unlink(missing_ok=True)


def test_working_directory_is_entered_as_the_user() -> None:
    """A wrapper that asks for another user's 0700 directory as the tree's cwd: the tree starts in /tmp,
    since the directory is entered without privileges."""
    other = pwd.getpwnam("ckptuser2")
    private = Path(f"/var/tmp/slurmckpt-private-{uuid.uuid4().hex}")
    private.mkdir(mode=0o700)
    os.chown(private, other.pw_uid, other.pw_gid)
    attack = f"""
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["/bin/sh", "-c", "pwd; ls . 2>&1 | head -1"],
        env={{"PATH": "/usr/bin:/bin"}}, cwd="{private}")
os.close(w)
out = b""
while chunk := os.read(r, 4096):
    out += chunk
results.append(["output", "ok", out.decode()])
"""
    try:
        results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
    finally:
        private.rmdir()
    assert results["launch"][0] == "ok", results
    out = results["output"][1]
    lines = out.splitlines()
    assert "/tmp" in lines and str(private) not in lines and "cannot chdir" in out, out


def test_user_can_touch_neither_the_init_directory_nor_the_freeze_control() -> None:
    """The namespace init's cwd (where CRIU's parasite mounts proc) is root's: the job's user can create,
    rename or replace nothing in it; the freeze control is root's: the user cannot freeze its own tree.
    Captures still work (the init creates the mount point with CAP_DAC_OVERRIDE)."""
    wd = workdir(USER, "initdir")
    job = submit(USER, wd, "#!/bin/bash\npython3 -c 'import time\nfor i in range(600): time.sleep(0.1)'\n",
                 "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        home = os.readlink(f"/proc/{_ns_init(job.id)}/cwd")
        st = os.stat(home)
        assert (st.st_uid, st.st_mode & 0o022) == (0, 0), f"{home} must be root's and not writable by others"
        for cmd in (["mkdir", f"{home}/proc.crtools"], ["ln", "-s", "/", f"{home}/proc.crtools"],
                    ["mv", home, f"{home}.moved"]):
            p = run(*cmd, user=USER, check=False)
            assert p.returncode != 0, f"{cmd} worked as the job's user"
        cg = task_cgroups(job.id)[0]
        word = "FROZEN" if cg.v1 else "1"
        p = run("sh", "-c", f"echo {word} > {cg.control}", user=USER, check=False)
        assert p.returncode != 0 and cg.state() == "THAWED", "the user froze its tree"
        job.wait_output(r"committed \(interval\)", 2, timeout=60)
    finally:
        run("scancel", str(job.id))


def test_output_fd_the_user_cannot_read_is_never_copied() -> None:
    """A wrapper whose stdout is an O_PATH fd on a root-only file: the capture refuses it, and no image
    holds the file's content. Root itself could read it through /proc/PID/fd (the attack); the job user
    cannot."""
    secret = Path(f"/var/tmp/slurmckpt-secret-{uuid.uuid4().hex}")
    token = uuid.uuid4().hex
    secret.write_text(token)
    secret.chmod(0o600)
    fd = os.open(secret, os.O_PATH)
    try:
        assert open(f"/proc/self/fd/{fd}").read() == token, "the attack's premise: root reads an O_PATH fd"
        pw = pwd.getpwnam(USER)
        try:
            asuser.open_as_user(Credentials(pw.pw_uid, pw.pw_gid, (), ()), f"/proc/self/fd/{fd}", os.O_RDONLY)
            raise AssertionError("the job's user opened a root-only file")
        except PermissionDenied:
            pass
    finally:
        os.close(fd)
    attack = f"""
fd = os.open("{secret}", os.O_PATH)
os.dup2(fd, 1)
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["sleep", "30"], env={{"PATH": "/usr/bin:/bin"}}, cwd="/tmp")
attempt("prepare", "prepare", epoch=1)
attempt("capture", "capture", epoch=1, final=False)
"""
    try:
        results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
        assert results["launch"][0] == "ok", results
        assert results["capture"][0] != "ok" and "O_PATH" in results["capture"][1], results
        leaked = subprocess.run(["grep", "-rl", token, "/var/lib/slurmckpt/images"], capture_output=True,
                                text=True).stdout
        assert not leaked, f"the secret was copied into {leaked}"
    finally:
        secret.unlink()


def test_special_file_stdout_is_not_copied() -> None:
    """A wrapper whose stdout is a character device (/dev/zero, endless when read): the capture copies
    nothing of it (only regular files are snapshotted) and still completes."""
    attack = """
fd = os.open("/dev/zero", os.O_RDWR)
os.dup2(fd, 1)
os.dup2(fd, 2)      # not the test runner's stderr (a file of root's, which the user may not read)
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["sleep", "30"], env={"PATH": "/usr/bin:/bin"}, cwd="/tmp")
attempt("prepare", "prepare", epoch=2)
attempt("capture", "capture", epoch=2, final=False)
attempt("resume", "resume", epoch=2)
"""
    results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
    assert results["capture"][0] == "ok" and results["resume"][0] == "ok", results
    snaps = list(Path("/var/lib/slurmckpt/images").glob("*/990001/epoch-000002/*/output-*.snap"))
    assert not snaps, f"a special file was snapshotted: {snaps}"
